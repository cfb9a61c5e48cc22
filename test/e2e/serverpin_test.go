package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientauthenticationv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// pluginRun is what one run of the credbroker-plugin binary left behind.
type pluginRun struct {
	code           int
	stdout, stderr string
}

// runPlugin runs the real plugin binary against the first broker as client-go
// would, with KUBERNETES_EXEC_INFO naming server and, in spec.cluster.config,
// the ClusterProfile fleet/<profile>.
func runPlugin(t *testing.T, c consumer, server, profile string, args ...string) pluginRun {
	t.Helper()
	return runPluginFor(t, c, clientauthenticationv1.Cluster{Server: server}, profile, args...)
}

// runPluginFor is runPlugin with cluster as KUBERNETES_EXEC_INFO's
// spec.cluster, whose config it sets to name fleet/<profile>.
func runPluginFor(t *testing.T, c consumer, cluster clientauthenticationv1.Cluster, profile string, args ...string) pluginRun {
	t.Helper()
	tokenFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	config, err := json.Marshal(plugin.ExecConfig{ClusterProfile: &plugin.Reference{Namespace: framework.FleetNamespace, Name: profile}})
	require.NoError(t, err)
	cluster.Config = runtime.RawExtension{Raw: config}
	info, err := json.Marshal(clientauthenticationv1.ExecCredential{
		TypeMeta: metav1.TypeMeta{APIVersion: "client.authentication.k8s.io/v1", Kind: "ExecCredential"},
		Spec:     clientauthenticationv1.ExecCredentialSpec{Interactive: false, Cluster: &cluster},
	})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, pluginBin, append([]string{
		"--broker-address", deployment.Broker.ExchangeAddr(),
		"--ca-file", deployment.CAFile,
		"--token-file", tokenFile,
	}, args...)...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(), "KUBERNETES_EXEC_INFO=" + string(info)}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	run := pluginRun{stdout: stdout.String(), stderr: stderr.String()}
	if exitErr := (*exec.ExitError)(nil); errors.As(err, &exitErr) {
		run.code = exitErr.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return run
}

// The plugin hands a token only to the server of the ClusterProfile it got
// the token for. Whoever writes a ClusterProfile's status can point its
// access provider at any server, with an exec config naming another
// ClusterProfile; without the check a consumer that builds a client for
// that profile sends the other cluster's token to the attacker's server.
func TestPluginPinsServer(t *testing.T) {
	spoke := env.Spokes[0]
	// Granted and opted in: the exchange itself succeeds, so only the
	// plugin's check stands between the token and the foreign server.
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "pinned", c.username())

	t.Run("foreign server", func(t *testing.T) {
		const attacker = "https://127.0.0.1:1"
		run := runPlugin(t, c, attacker, spoke.Name)
		assert.Equal(t, 1, run.code, "stderr: %s", run.stderr)
		assert.Empty(t, run.stdout, "no ExecCredential, and so no token, on stdout")
		assert.Contains(t, run.stderr, attacker)
		assert.Contains(t, run.stderr, spoke.Server)
		assert.Contains(t, run.stderr, framework.FleetNamespace+"/"+spoke.Name)
		assert.NotContains(t, run.stderr, c.token)
	})

	// The cluster's own server, but a client that would trust, or go
	// through, someone else on the way: an attacker in the network path
	// (DNS, a proxy) reads the token as surely as at a server of theirs.
	attackerCA, err := testpki.NewCA("attacker.test")
	require.NoError(t, err)
	refusals := []struct {
		name    string
		cluster clientauthenticationv1.Cluster
		wantErr []string
	}{
		{
			name:    "the cluster's server with a foreign CA",
			cluster: clientauthenticationv1.Cluster{Server: spoke.Server, CertificateAuthorityData: attackerCA.BundlePEM()},
			wantErr: []string{"certificate-authority-data", fingerprint(attackerCA.BundlePEM()), fingerprint(spoke.CAData)},
		},
		{
			// Without a CA the client trusts the system roots, not the
			// cluster's CA.
			name:    "the cluster's server without its CA",
			cluster: clientauthenticationv1.Cluster{Server: spoke.Server},
			wantErr: []string{"certificate-authority-data", "none", fingerprint(spoke.CAData)},
		},
		{
			name:    "the cluster's server without verifying it",
			cluster: clientauthenticationv1.Cluster{Server: spoke.Server, CertificateAuthorityData: spoke.CAData, InsecureSkipTLSVerify: true},
			wantErr: []string{"insecure-skip-tls-verify"},
		},
		{
			name:    "the cluster's server through a proxy",
			cluster: clientauthenticationv1.Cluster{Server: spoke.Server, CertificateAuthorityData: spoke.CAData, ProxyURL: "http://127.0.0.1:1"},
			wantErr: []string{"proxy-url", "http://127.0.0.1:1", "not supported"},
		},
	}
	for _, tt := range refusals {
		t.Run(tt.name, func(t *testing.T) {
			run := runPluginFor(t, c, tt.cluster, spoke.Name)
			t.Logf("plugin stderr: %s", run.stderr)
			assert.Equal(t, 1, run.code, "stderr: %s", run.stderr)
			// Not assert.Empty, which would print the token.
			assert.True(t, run.stdout == "", "no ExecCredential, and so no token, on stdout; got %d bytes", len(run.stdout))
			assert.Contains(t, run.stderr, framework.FleetNamespace+"/"+spoke.Name)
			assert.Contains(t, run.stderr, "permission denied")
			for _, s := range tt.wantErr {
				assert.Contains(t, run.stderr, s)
			}
			assert.NotContains(t, run.stderr, c.token)
			assert.NotContains(t, run.stderr, "BEGIN CERTIFICATE")
		})
	}

	t.Run("the cluster's server and CA", func(t *testing.T) {
		run := runPluginFor(t, c, clientauthenticationv1.Cluster{Server: spoke.Server, CertificateAuthorityData: spoke.CAData}, spoke.Name)
		assertSpokeToken(t, run, spoke, ns)
	})

	t.Run("the cluster's server in another spelling", func(t *testing.T) {
		server := "HTTPS://" + strings.TrimPrefix(spoke.Server, "https://") + "/"
		run := runPluginFor(t, c, clientauthenticationv1.Cluster{Server: server, CertificateAuthorityData: spoke.CAData}, spoke.Name)
		assertSpokeToken(t, run, spoke, ns)
	})
}

// assertSpokeToken checks that run printed an ExecCredential whose token
// spoke accepts as the ServiceAccount <ns>/pinned.
func assertSpokeToken(t *testing.T, run pluginRun, spoke *framework.Cluster, ns string) {
	t.Helper()
	require.Equal(t, 0, run.code, "stderr: %s", run.stderr)
	var ec clientauthenticationv1.ExecCredential
	require.NoError(t, json.Unmarshal([]byte(run.stdout), &ec))
	require.NotNil(t, ec.Status)
	review, err := spoke.ReviewToken(t.Context(), ec.Status.Token, nil)
	require.NoError(t, err)
	require.True(t, review.Authenticated, review.Error)
	assert.Equal(t, "system:serviceaccount:"+ns+":pinned", review.User.Username)
}

// fingerprint is how the plugin names a CA bundle in its errors.
func fingerprint(pem []byte) string {
	sum := sha256.Sum256(bytes.TrimSpace(pem))
	return "SHA-256 " + hex.EncodeToString(sum[:])
}

// The broker never answers with an empty server, which the plugin could not
// check: a ClusterProfile without a server is refused before any mint.
func TestClusterProfileWithoutServer(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name := uniqueName(t, "no-server")
	ext, err := json.Marshal(plugin.ExecConfig{ClusterProfile: &plugin.Reference{Namespace: framework.FleetNamespace, Name: name}})
	require.NoError(t, err)
	// The credbroker access provider lacks its server, and no other
	// provider has one.
	_, err = env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, &framework.Access{ProviderName: plugin.Name, CAData: spoke.CAData, ExecConfig: ext})
	require.NoError(t, err)
	// An agent on spoke that serves that ClusterProfile, so that without the
	// check the exchange would mint.
	stop, err := deployment.StartAgent(ctx, spoke, framework.AgentID(name))
	require.NoError(t, err)
	t.Cleanup(stop)

	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "serverless", c.username())

	_, err = exchange(t, c, &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: name}})
	st := status.Convert(err)
	assert.Equal(t, codes.FailedPrecondition, st.Code(), st.Message())
	assert.Contains(t, st.Message(), "fleet/"+name)
	assert.Contains(t, st.Message(), `"credbroker"`)
	assert.False(t, strings.Contains(logs.String(), `"msg"="minted spoke token" "spoke"="`+spoke.Name+`" "subject"="`+c.username()+`" "serviceAccount"="`+ns+`/serverless"`),
		"the agent minted a token for a ClusterProfile without a server")
}
