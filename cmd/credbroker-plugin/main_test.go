package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"encoding/pem"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientauthenticationv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	clientcmdlatest "k8s.io/client-go/tools/clientcmd/api/latest"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	clusterinventoryv1alpha1 "sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/plugin"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

const (
	hubToken   = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJodWIifQ.c2lnbmF0dXJl"
	spokeToken = "spoke-token-from-binary-test"
	denied     = "system:serviceaccount:apps:ci may not use fleet/denied"
)

var expiry = time.Date(2031, 1, 2, 3, 4, 5, 0, time.UTC)

// spokeServer is the spoke API server the fake broker reports, and the one
// execInfo names, unless a test says otherwise.
const spokeServer = "https://spoke.example:6443"

// fakeBroker checks the bearer token, records requests, denies the
// ClusterProfile fleet/denied and answers every other one with spokeToken
// and the server and CA set by setCluster (default spokeServer and none).
type fakeBroker struct {
	credbrokerv1alpha1.UnimplementedTokenExchangeServer

	mu       sync.Mutex
	requests []*credbrokerv1alpha1.ExchangeRequest
	server   string
	ca       []byte
	// refusals are the next answers: ResourceExhausted, with a retry-after
	// trailer of that many seconds, none when empty.
	refusals []string
}

// refuse queues refusals for the next exchanges.
func (f *fakeBroker) refuse(retryAfter ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refusals = append(f.refusals, retryAfter...)
}

func (f *fakeBroker) setCluster(server string, ca []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.server, f.ca = server, ca
}

func (f *fakeBroker) Exchange(ctx context.Context, req *credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer "+hubToken {
		return nil, status.Error(codes.Unauthenticated, "fake broker: wrong or missing authorization metadata")
	}
	f.mu.Lock()
	f.requests = append(f.requests, proto.CloneOf(req))
	server, ca := cmp.Or(f.server, spokeServer), f.ca
	var refuse *string
	if len(f.refusals) > 0 {
		refuse = &f.refusals[0]
		f.refusals = f.refusals[1:]
	}
	f.mu.Unlock()
	if refuse != nil {
		if *refuse != "" {
			_ = grpc.SetTrailer(ctx, metadata.Pairs("retry-after", *refuse))
		}
		return nil, status.Error(codes.ResourceExhausted, "system:serviceaccount:apps:ci asked for more than 20 mints per second (burst 2000)")
	}
	if req.GetCluster().GetName() == "denied" {
		return nil, status.Error(codes.PermissionDenied, denied)
	}
	return &credbrokerv1alpha1.ExchangeResponse{Token: spokeToken, ExpirationTime: timestamppb.New(expiry), Server: server, CertificateAuthorityData: ca}, nil
}

func (f *fakeBroker) received() []*credbrokerv1alpha1.ExchangeRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*credbrokerv1alpha1.ExchangeRequest(nil), f.requests...)
}

// buildPlugin builds this command into a temporary directory.
func buildPlugin(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	require.NoError(t, err, "this test builds the plugin and needs the go command on PATH")
	bin := filepath.Join(t.TempDir(), "credbroker-plugin")
	out, err := exec.Command(goBin, "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// -v/--v is taken, as on the other binaries, and --version prints the
// version and exits 0 without asking the broker.
func TestVersionAndVerbosity(t *testing.T) {
	bin := buildPlugin(t)
	for _, args := range [][]string{{"--version"}, {"-v=2", "--version"}, {"--v=2", "--version"}} {
		t.Run(strings.Join(args, " "), func(t *testing.T) {
			out, err := exec.CommandContext(t.Context(), bin, args...).Output()
			require.NoError(t, err)
			assert.Regexp(t, `^credbroker-plugin \S+ \(revision \S+, go\S+\)\n$`, string(out))
		})
	}
}

func execInfo(config string) string { return execInfoFor(spokeServer, config) }

// execInfoFor is execInfo for a cluster whose server is server.
func execInfoFor(server, config string) string {
	cluster := `{"server":"` + server + `"`
	if config != "" {
		cluster += `,"config":` + config
	}
	cluster += `}`
	return `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","spec":{"interactive":false,"cluster":` + cluster + `}}`
}

func TestBinary(t *testing.T) {
	bin := buildPlugin(t)

	dir := t.TempDir()
	ca, err := testpki.NewCA("plugin.test")
	require.NoError(t, err)
	caFile, err := ca.WriteBundle(dir)
	require.NoError(t, err)
	certFile, keyFile, err := ca.WriteServing(dir, "127.0.0.1")
	require.NoError(t, err)
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	require.NoError(t, err)
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(hubToken+"\n"), 0o600))

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}})))
	fake := &fakeBroker{}
	credbrokerv1alpha1.RegisterTokenExchangeServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	base := []string{"--broker-address", lis.Addr().String(), "--ca-file", caFile, "--token-file", tokenFile, "--timeout", "10s"}
	withBase := func(args ...string) []string { return append(append([]string(nil), base...), args...) }
	const prod = `{"clusterProfile":{"namespace":"fleet","name":"prod-eu-1"}}`

	// A ClusterProfile's additional-args, appended after the provider
	// file's (profileSourcedCLIArgsPolicy: Append), point at a listener
	// that the plugin would trust: same CA, the attacker's server. It must
	// never see a connection, in any case below.
	evil := startRecorder(t, cert)
	evilCA, err := testpki.NewCA("attacker.test")
	require.NoError(t, err)
	evilCAFile, err := evilCA.WriteBundle(t.TempDir())
	require.NoError(t, err)
	attackerToken := filepath.Join(dir, "api-audience-token")
	require.NoError(t, os.WriteFile(attackerToken, []byte(hubToken+"\n"), 0o600))
	const overridden = "a ClusterProfile's additional-args may not override it"

	tests := []struct {
		name     string
		args     []string
		execInfo string // KUBERNETES_EXEC_INFO; unset when empty
		wantCode int
		// wantCluster is the ClusterProfile the broker must see, "" for none.
		wantCluster string
		// wantAudiences, when set, are the audiences the broker must see.
		wantAudiences []string
		wantStderr    string
	}{
		{name: "cluster from exec info", args: base, execInfo: execInfo(prod), wantCluster: "fleet/prod-eu-1"},
		{name: "cluster from flag", args: withBase("--cluster", "fleet/staging"), execInfo: execInfo(prod), wantCluster: "fleet/staging"},
		{
			name: "denied", args: base, execInfo: execInfo(`{"clusterProfile":{"namespace":"fleet","name":"denied"}}`),
			wantCode: 1, wantCluster: "fleet/denied",
			wantStderr: "[credbroker] exchange for cluster fleet/denied: permission denied: " + denied + "; ",
		},
		{
			// A ClusterProfile status writer pointed an access provider at
			// their own server, with the exec config naming fleet/prod-eu-1.
			name: "server is not the cluster's", args: base, execInfo: execInfoFor("https://attacker.example", prod),
			wantCode: 1, wantCluster: "fleet/prod-eu-1",
			wantStderr: "https://attacker.example",
		},
		{
			name: "server is not the --cluster's", args: withBase("--cluster", "fleet/staging"), execInfo: execInfoFor("https://attacker.example", prod),
			wantCode: 1, wantCluster: "fleet/staging",
			wantStderr: spokeServer,
		},
		{name: "server in another spelling", args: base, execInfo: execInfoFor("https://SPOKE.example:6443/", prod), wantCluster: "fleet/prod-eu-1"},
		{name: "no cluster", args: base, execInfo: execInfo(""), wantCode: 1, wantStderr: "[credbroker] no ClusterProfile to get a token for"},
		{name: "no exec info", args: base, wantCode: 1, wantStderr: "[credbroker] failed to read KUBERNETES_EXEC_INFO"},
		{
			name: "missing token file", args: append(base[:4:4], "--token-file", filepath.Join(dir, "missing")), execInfo: execInfo(prod),
			wantCode: 1, wantStderr: "[credbroker] read hub token: open " + filepath.Join(dir, "missing"),
		},
		{name: "bad flag", args: []string{"--ca-file", caFile}, execInfo: execInfo(prod), wantCode: 2, wantStderr: "[credbroker] --broker-address is required"},
		{
			name: "broker address given twice", args: withBase("--broker-address", evil.addr()), execInfo: execInfo(prod),
			wantCode: 2, wantStderr: `"--broker-address"`,
		},
		{
			name: "broker address given twice, with =", args: withBase("--broker-address=" + evil.addr()), execInfo: execInfo(prod),
			wantCode: 2, wantStderr: overridden,
		},
		{
			name: "CA file given twice", args: withBase("--ca-file", evilCAFile), execInfo: execInfo(prod),
			wantCode: 2, wantStderr: `"--ca-file"`,
		},
		{name: "token file given twice", args: withBase("--token-file", attackerToken), execInfo: execInfo(prod), wantCode: 2, wantStderr: `"--token-file"`},
		{name: "cluster given twice", args: withBase("--cluster", "fleet/staging", "--cluster", "fleet/prod-eu-1"), execInfo: execInfo(prod), wantCode: 2, wantStderr: `"--cluster"`},
		{
			name: "service account given twice", args: withBase("--service-account", "apps/a", "--service-account=apps/b"), execInfo: execInfo(prod),
			wantCode: 2, wantStderr: `"--service-account"`,
		},
		{
			// Older credbroker kubeconfig wrote one --audience per audience.
			// An appended audience cannot redirect the token, and the
			// spoke's opt-in must allow it.
			name: "audience given twice adds one", args: withBase("--audience", "a", "--audience", "sts.amazonaws.com", "--audience", "a"),
			execInfo: execInfo(prod), wantCluster: "fleet/prod-eu-1", wantAudiences: []string{"a", "sts.amazonaws.com"},
		},
		{name: "expiration given twice", args: withBase("--expiration-seconds", "600", "--expiration-seconds", "86400"), execInfo: execInfo(prod), wantCode: 2, wantStderr: `"--expiration-seconds"`},
		{name: "timeout given twice", args: withBase("--timeout", "1s"), execInfo: execInfo(prod), wantCode: 2, wantStderr: `"--timeout"`},
		{
			// pkg/access appends a profile's additional-args again on every
			// BuildConfigFromCP of one process, so the same flags come many
			// times over.
			name: "identical repeats", args: append(withBase(base...), append(base, "--cluster", "fleet/staging", "--cluster=fleet/staging")...),
			execInfo: execInfo(prod), wantCluster: "fleet/staging",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before, dialed := len(fake.received()), evil.connections()
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin, tt.args...)
			cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}
			if tt.execInfo != "" {
				cmd.Env = append(cmd.Env, "KUBERNETES_EXEC_INFO="+tt.execInfo)
			}
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			err := cmd.Run()

			code := 0
			if exitErr := (*exec.ExitError)(nil); errors.As(err, &exitErr) {
				code = exitErr.ExitCode()
			} else {
				require.NoError(t, err)
			}
			assert.Equal(t, dialed, evil.connections(), "the plugin connected to the address that a second --broker-address named")
			require.Equal(t, tt.wantCode, code, "stderr: %s", stderr.String())
			assert.NotContains(t, stderr.String(), hubToken)
			assert.NotContains(t, stdout.String(), hubToken)
			assert.NotContains(t, stderr.String(), spokeToken)

			got := fake.received()[before:]
			if tt.wantCluster == "" {
				assert.Empty(t, got, "the broker must not be called")
			} else if assert.Len(t, got, 1) {
				assert.Equal(t, tt.wantCluster, got[0].GetCluster().GetNamespace()+"/"+got[0].GetCluster().GetName())
				if tt.wantAudiences != nil {
					assert.Equal(t, tt.wantAudiences, got[0].GetAudiences())
				}
			}

			if tt.wantCode != 0 {
				assert.Contains(t, stderr.String(), tt.wantStderr)
				assert.Empty(t, stdout.String(), "nothing on stdout on failure")
				return
			}
			assert.Empty(t, stderr.String())
			var raw map[string]any
			require.NoError(t, json.Unmarshal(stdout.Bytes(), &raw), "stdout: %s", stdout.String())
			assert.Equal(t, "client.authentication.k8s.io/v1", raw["apiVersion"])
			assert.Equal(t, "ExecCredential", raw["kind"])
			var ec clientauthenticationv1.ExecCredential
			require.NoError(t, json.Unmarshal(stdout.Bytes(), &ec))
			require.NotNil(t, ec.Status)
			assert.Equal(t, spokeToken, ec.Status.Token)
			require.NotNil(t, ec.Status.ExpirationTimestamp)
			assert.True(t, expiry.Equal(ec.Status.ExpirationTimestamp.Time), "expirationTimestamp %v, want %v", ec.Status.ExpirationTimestamp, expiry)
			assert.Equal(t, "2031-01-02T03:04:05Z", raw["status"].(map[string]any)["expirationTimestamp"])
		})
	}

	// The broker's rate limit refuses the first exchange: with a
	// retry-after of 1s, the binary waits it out, asks again and prints the
	// credential; without one, it fails at once.
	for _, tt := range []struct {
		name, retryAfter string
		wantCode         int
	}{
		{name: "rate limited with a retry-after", retryAfter: "1"},
		{name: "rate limited without a retry-after", wantCode: 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			before := len(fake.received())
			fake.refuse(tt.retryAfter)
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, bin, base...)
			cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(), "KUBERNETES_EXEC_INFO=" + execInfo(prod)}
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			began := time.Now()
			err := cmd.Run()
			took := time.Since(began)
			assert.NotContains(t, stderr.String(), hubToken)
			if tt.wantCode != 0 {
				var exitErr *exec.ExitError
				require.ErrorAs(t, err, &exitErr)
				assert.Equal(t, tt.wantCode, exitErr.ExitCode())
				assert.Contains(t, stderr.String(), "[credbroker] exchange for cluster fleet/prod-eu-1: resource exhausted: ")
				assert.Empty(t, stdout.String())
				assert.Len(t, fake.received()[before:], 1, "a refusal without a retry-after is not asked again")
				return
			}
			require.NoError(t, err, "stderr: %s", stderr.String())
			assert.Empty(t, stderr.String())
			assert.GreaterOrEqual(t, took, time.Second, "the plugin waited the retry-after")
			assert.Len(t, fake.received()[before:], 2, "refused once, then asked again")
			var ec clientauthenticationv1.ExecCredential
			require.NoError(t, json.Unmarshal(stdout.Bytes(), &ec), "stdout: %s", stdout.String())
			require.NotNil(t, ec.Status)
			assert.Equal(t, spokeToken, ec.Status.Token)
		})
	}

	// client-go runs the plugin as a ClusterProfile's access provider would
	// have it: the exec extension of the credbroker access provider's cluster
	// becomes spec.cluster.config.
	t.Run("client-go through a ClusterProfile", func(t *testing.T) {
		before := len(fake.received())
		gotAuth := make(chan string, 1)
		spoke := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case gotAuth <- r.Header.Get("Authorization"):
			default:
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"kind":"APIVersions","versions":["v1"]}`))
		}))
		t.Cleanup(spoke.Close)
		spokeCA := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: spoke.Certificate().Raw})
		fake.setCluster(spoke.URL, spokeCA)
		t.Cleanup(func() { fake.setCluster("", nil) })

		cp := clusterinventoryv1alpha1.ClusterProfile{
			ObjectMeta: metav1.ObjectMeta{Namespace: "fleet", Name: "prod-eu-1"},
			Status: clusterinventoryv1alpha1.ClusterProfileStatus{
				AccessProviders: []clusterinventoryv1alpha1.AccessProvider{{
					Name: plugin.Name,
					Cluster: clientcmdv1.Cluster{
						Server:                   spoke.URL,
						CertificateAuthorityData: spokeCA,
						Extensions: []clientcmdv1.NamedExtension{{
							Name:      "client.authentication.k8s.io/exec",
							Extension: runtime.RawExtension{Raw: []byte(prod)},
						}},
					},
				}},
			},
		}
		// What sigs.k8s.io/cluster-inventory-api/pkg/access BuildConfigFromCP does.
		ap := cp.Status.AccessProviders[0]
		internal := clientcmdapi.NewCluster()
		require.NoError(t, clientcmdlatest.Scheme.Convert(&ap.Cluster, internal, nil))
		cfg := &rest.Config{
			Host:            ap.Cluster.Server,
			TLSClientConfig: rest.TLSClientConfig{CAData: ap.Cluster.CertificateAuthorityData},
			ExecProvider: &clientcmdapi.ExecConfig{
				APIVersion:         "client.authentication.k8s.io/v1",
				Command:            bin,
				Args:               base,
				InteractiveMode:    clientcmdapi.NeverExecInteractiveMode,
				ProvideClusterInfo: true,
				Config:             internal.Extensions["client.authentication.k8s.io/exec"],
			},
		}
		hc, err := rest.HTTPClientFor(cfg)
		require.NoError(t, err)
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, spoke.URL+"/api", nil)
		require.NoError(t, err)
		resp, err := hc.Do(req)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Equal(t, "Bearer "+spokeToken, <-gotAuth)

		got := fake.received()[before:]
		require.Len(t, got, 1)
		assert.Equal(t, "fleet", got[0].GetCluster().GetNamespace())
		assert.Equal(t, "prod-eu-1", got[0].GetCluster().GetName())
	})
}

// recorder is a TLS listener that counts the connections it accepts and
// closes them at once.
type recorder struct {
	lis net.Listener
	n   atomic.Int64
}

func startRecorder(t *testing.T, cert tls.Certificate) *recorder {
	t.Helper()
	lis, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert}})
	require.NoError(t, err)
	r := &recorder{lis: lis}
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			r.n.Add(1)
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = lis.Close() })
	return r
}

func (r *recorder) addr() string { return r.lis.Addr().String() }

func (r *recorder) connections() int64 { return r.n.Load() }
