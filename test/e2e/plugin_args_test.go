package e2e

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// profileArgsExtension is the ClusterProfile cluster extension whose
// arguments cluster-inventory-api's pkg/access appends to the provider
// file's exec args under profileSourcedCLIArgsPolicy: Append (KEP-5339).
const profileArgsExtension = "clusterprofiles.multicluster.x-k8s.io/exec/additional-args"

// fakeBrokerListener is a TokenExchange server over TLS, under a CA of its
// own, that counts the connections it accepts and the calls that carried an
// Authorization header: a hub token sent there is a stolen hub token.
type fakeBrokerListener struct {
	pb.UnimplementedTokenExchangeServer
	addr    string
	caFile  string
	conns   atomic.Int32
	bearers atomic.Int32
}

func (f *fakeBrokerListener) Exchange(ctx context.Context, _ *pb.ExchangeRequest) (*pb.ExchangeResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if len(md.Get("authorization")) > 0 {
		f.bearers.Add(1)
	}
	return nil, status.Error(codes.Unavailable, "fake broker")
}

// countingListener counts the connections it accepts.
type countingListener struct {
	net.Listener
	n *atomic.Int32
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

func startFakeBrokerListener(t *testing.T) *fakeBrokerListener {
	t.Helper()
	dir := t.TempDir()
	ca, err := testpki.NewCA("attacker.test")
	require.NoError(t, err)
	caFile, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	certFile, keyFile, err := ca.WriteServing(dir, "127.0.0.1")
	require.NoError(t, err)
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	f := &fakeBrokerListener{addr: lis.Addr().String(), caFile: caFile}
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}})))
	pb.RegisterTokenExchangeServer(srv, f)
	go func() { _ = srv.Serve(countingListener{Listener: lis, n: &f.conns}) }()
	t.Cleanup(srv.Stop)
	return f
}

// withProfileArgs returns a copy of cp whose credbroker access provider
// carries args in the additional-args extension, as a status writer would
// put them there.
func withProfileArgs(t *testing.T, cp *v1alpha1.ClusterProfile, args ...string) *v1alpha1.ClusterProfile {
	t.Helper()
	raw, err := json.Marshal(args)
	require.NoError(t, err)
	cp = cp.DeepCopy()
	for i := range cp.Status.AccessProviders {
		p := &cp.Status.AccessProviders[i]
		if p.Name == plugin.Name {
			p.Cluster.Extensions = append(p.Cluster.Extensions, clientcmdv1.NamedExtension{
				Name: profileArgsExtension, Extension: runtime.RawExtension{Raw: raw},
			})
			return cp
		}
	}
	t.Fatalf("ClusterProfile %s/%s has no %s access provider", cp.Namespace, cp.Name, plugin.Name)
	return nil
}

// accessConfig is a pkg/access configuration, as loaded from a provider
// file, that runs the plugin against the first broker with c's hub token,
// under the profile-sourced args policy.
func accessConfig(t *testing.T, c consumer, policy access.ProfileSourcedCLIArgsPolicy) *access.Config {
	t.Helper()
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	raw, err := json.Marshal(access.Config{Providers: []access.Provider{{
		Name: plugin.Name,
		ExecConfig: &clientcmdapi.ExecConfig{
			APIVersion: "client.authentication.k8s.io/v1", Command: pluginBin, ProvideClusterInfo: true,
			Args: []string{"--broker-address", deployment.Broker.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", tokenFile},
		},
		ProfileSourcedCLIArgsPolicy: policy,
	}}})
	require.NoError(t, err)
	providerFile := filepath.Join(dir, "providers.json")
	require.NoError(t, os.WriteFile(providerFile, raw, 0o600))
	loaded, err := access.NewFromFile(providerFile)
	require.NoError(t, err)
	return loaded
}

// Trust boundary: whoever writes a ClusterProfile's status cannot redirect
// the plugin. With a provider file's profileSourcedCLIArgsPolicy: Append,
// pkg/access appends the profile's additional-args to the plugin's, and a
// flag given last used to win: --broker-address and --ca-file of the
// attacker's took the consumer's hub token to the attacker, and that token
// works at the real broker for every profile the consumer may use. The
// plugin now refuses a flag given again with another value, before it
// connects anywhere. deploy/hub/admission.yaml refuses such a status write
// too (TestProfileCannotNameAnotherProfilesExecConfig); this test proves the
// plugin's own defence, so it hands pkg/access the profile as a status
// writer would leave it where that policy is not installed.
//
// pkg/access appends the same additional-args again on every
// BuildConfigFromCP of one process, so the same flags repeated keep
// working.
func TestProfileSourcedArgsCannotRedirectThePlugin(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "args-reader", c.username())
	cp, err := deployment.ClusterProfile(ctx, spoke)
	require.NoError(t, err)

	t.Run("another broker address and CA", func(t *testing.T) {
		evil := startFakeBrokerListener(t)
		attacked := withProfileArgs(t, cp, "--broker-address="+evil.addr, "--ca-file="+evil.caFile)
		restConfig, err := accessConfig(t, c, access.ProfileSourcedCLIArgsPolicyAppend).BuildConfigFromCP(attacked)
		require.NoError(t, err)
		require.Contains(t, restConfig.ExecProvider.Args, "--broker-address="+evil.addr, "pkg/access appended the profile's args")
		client, err := kubernetes.NewForConfig(restConfig)
		require.NoError(t, err)

		_, err = client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
		require.Error(t, err, "the plugin gave a token")
		assert.Contains(t, err.Error(), "failed with exit code 2")
		assert.NotContains(t, err.Error(), c.token)
		assert.Zero(t, evil.bearers.Load(), "the attacker's listener received the consumer's hub token")
		assert.Zero(t, evil.conns.Load(), "the plugin connected to the attacker's listener")
	})

	t.Run("the same args on every BuildConfigFromCP", func(t *testing.T) {
		// Benign profile args, which a provider file with Append allows.
		benign := withProfileArgs(t, cp, "--service-account="+ns+"/args-reader", "--timeout=20s")
		loaded := accessConfig(t, c, access.ProfileSourcedCLIArgsPolicyAppend)
		var clients []kubernetes.Interface
		for range 3 {
			restConfig, err := loaded.BuildConfigFromCP(benign)
			require.NoError(t, err)
			client, err := kubernetes.NewForConfig(restConfig)
			require.NoError(t, err)
			clients = append(clients, client)
		}
		var wg sync.WaitGroup
		for i, client := range clients {
			wg.Go(func() {
				self, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
				if assert.NoError(t, err, "client %d", i) {
					assert.Equal(t, "system:serviceaccount:"+ns+":args-reader", self.Status.UserInfo.Username)
				}
			})
		}
		wg.Wait()
	})
}
