package plugin_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/runtime"
	clientauthenticationv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/plugin"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

func okResponse(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
	return &credbrokerv1alpha1.ExchangeResponse{
		Token:          testSpokeToken,
		ExpirationTime: timestamppb.New(testExpiry),
		Server:         "https://spoke.example:6443",
		ServiceAccount: &credbrokerv1alpha1.ObjectReference{Namespace: "apps", Name: "deployer"},
		CredentialId:   "JTI=abc",
	}, nil
}

// execCredential is what client-go passes with provideClusterInfo: true;
// config is spec.cluster.config, omitted when empty.
func execCredential(config string) clientauthenticationv1.ExecCredential {
	return execCredentialFor("https://spoke.example:6443", config)
}

// execCredentialFor is execCredential for a cluster whose server is server.
func execCredentialFor(server, config string) clientauthenticationv1.ExecCredential {
	ec := clientauthenticationv1.ExecCredential{
		Spec: clientauthenticationv1.ExecCredentialSpec{
			Cluster: &clientauthenticationv1.Cluster{Server: server},
		},
	}
	if config != "" {
		ec.Spec.Cluster.Config = runtime.RawExtension{Raw: []byte(config)}
	}
	return ec
}

const prodConfig = `{"clusterProfile":{"namespace":"fleet","name":"prod-eu-1"}}`

func ref(ns, name string) *plugin.Reference { return &plugin.Reference{Namespace: ns, Name: name} }

func objRef(ns, name string) *credbrokerv1alpha1.ObjectReference {
	return &credbrokerv1alpha1.ObjectReference{Namespace: ns, Name: name}
}

// withCluster returns in with f applied to its spec.cluster.
func withCluster(in clientauthenticationv1.ExecCredential, f func(*clientauthenticationv1.Cluster)) clientauthenticationv1.ExecCredential {
	c := *in.Spec.Cluster
	f(&c)
	in.Spec.Cluster = &c
	return in
}

// respondWithCA is okResponse with ca as the cluster's CA bundle.
func respondWithCA(ca []byte) func(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
	return func(req *credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
		resp, err := okResponse(req)
		resp.CertificateAuthorityData = ca
		return resp, err
	}
}

// respondWithServer is okResponse with server as the cluster's server.
func respondWithServer(server string) func(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
	return func(req *credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
		resp, err := okResponse(req)
		resp.Server = server
		return resp, err
	}
}

// caPEM returns the PEM certificate of a new CA.
func caPEM(t *testing.T, name string) []byte {
	t.Helper()
	ca, err := testpki.NewCA(name)
	require.NoError(t, err)
	return ca.BundlePEM()
}

// sha256Hex is the SHA-256 of b in lower-case hex.
func sha256Hex(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func TestGetToken(t *testing.T) {
	permissionDenied := func(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
		return nil, status.Error(codes.PermissionDenied, `system:serviceaccount:apps:ci may not use fleet/prod-eu-1`)
	}
	clusterCA := caPEM(t, "cluster.test")
	attackerCA := caPEM(t, "attacker.test")
	tests := []struct {
		name    string
		respond func(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error)
		cfg     func(*plugin.Config)
		in      clientauthenticationv1.ExecCredential
		// want is the request the broker must see; nil means none.
		want    *credbrokerv1alpha1.ExchangeRequest
		wantErr []string
		// notInErr must not appear in the error.
		notInErr []string
		code     codes.Code
		is       error
	}{
		{
			name: "cluster from spec.cluster.config",
			in:   execCredential(prodConfig),
			want: &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
		},
		{
			// A caller that builds the ExecCredential in Go may give the
			// config as an object rather than raw JSON.
			name: "cluster from spec.cluster.config as an object",
			in: withCluster(execCredential(""), func(c *clientauthenticationv1.Cluster) {
				c.Config = runtime.RawExtension{Object: &runtime.Unknown{Raw: []byte(prodConfig), ContentType: runtime.ContentTypeJSON}}
			}),
			want: &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
		},
		{
			name: "all request fields",
			cfg: func(c *plugin.Config) {
				c.ServiceAccount = ref("apps", "deployer")
				c.Audiences = []string{"https://kubernetes.default.svc", "vault"}
				c.ExpirationSeconds = 3600
			},
			in: execCredential(prodConfig),
			want: &credbrokerv1alpha1.ExchangeRequest{
				Cluster:           objRef("fleet", "prod-eu-1"),
				ServiceAccount:    objRef("apps", "deployer"),
				Audiences:         []string{"https://kubernetes.default.svc", "vault"},
				ExpirationSeconds: 3600,
			},
		},
		{
			name: "Config.Cluster overrides spec.cluster.config",
			cfg:  func(c *plugin.Config) { c.Cluster = ref("fleet", "staging") },
			in:   execCredential(prodConfig),
			want: &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "staging")},
		},
		{
			// Nothing to check the broker's server against: refused before
			// any token is minted.
			name:    "Config.Cluster without cluster info",
			cfg:     func(c *plugin.Config) { c.Cluster = ref("fleet", "staging") },
			in:      clientauthenticationv1.ExecCredential{},
			wantErr: []string{"no spec.cluster.server", "provideClusterInfo: true"},
			code:    codes.FailedPrecondition,
		},
		{
			name:    "Config.Cluster with cluster info without a server",
			cfg:     func(c *plugin.Config) { c.Cluster = ref("fleet", "staging") },
			in:      execCredentialFor("", prodConfig),
			wantErr: []string{"no spec.cluster.server", "provideClusterInfo: true"},
			code:    codes.FailedPrecondition,
		},
		{
			// The attack: a ClusterProfile status writer points some
			// profile's access provider at a server of theirs, with the
			// exec config naming fleet/prod-eu-1.
			name:    "exec info server is not the cluster's",
			in:      execCredentialFor("https://attacker.example", prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"fleet/prod-eu-1", "https://attacker.example", "https://spoke.example:6443"},
			code:    codes.PermissionDenied,
			is:      errdefs.ErrPermissionDenied,
		},
		{
			name:    "exec info server differs only in port",
			in:      execCredentialFor("https://spoke.example:443", prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"https://spoke.example:443", "https://spoke.example:6443"},
			code:    codes.PermissionDenied,
		},
		{
			name:    "exec info server differs only in path",
			in:      execCredentialFor("https://spoke.example:6443/proxy", prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"https://spoke.example:6443/proxy", "https://spoke.example:6443"},
			code:    codes.PermissionDenied,
		},
		{
			name:    "Config.Cluster names another cluster than the exec info server",
			cfg:     func(c *plugin.Config) { c.Cluster = ref("fleet", "staging") },
			in:      execCredentialFor("https://attacker.example", prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "staging")},
			wantErr: []string{"fleet/staging", "https://attacker.example", "https://spoke.example:6443"},
			code:    codes.PermissionDenied,
		},
		{
			name: "exec info server in another spelling of the cluster's",
			in:   execCredentialFor("HTTPS://Spoke.Example:6443/", prodConfig),
			want: &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
		},
		// The bypasses of the server pin: the right server, but a client
		// that would trust, or reach, someone else on the way to it.
		{
			name:    "exec info CA is not the cluster's",
			respond: respondWithCA(clusterCA),
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.CertificateAuthorityData = attackerCA
			}),
			want: &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"fleet/prod-eu-1", "https://spoke.example:6443", "certificate-authority-data",
				"SHA-256 " + sha256Hex(bytes.TrimSpace(attackerCA)), "SHA-256 " + sha256Hex(bytes.TrimSpace(clusterCA))},
			notInErr: []string{"BEGIN CERTIFICATE", string(attackerCA[30:60]), string(clusterCA[30:60])},
			code:     codes.PermissionDenied,
			is:       errdefs.ErrPermissionDenied,
		},
		{
			// Both empty would mean system roots on both sides; a CA the
			// cluster does not have is someone else's.
			name: "exec info has a CA, the cluster none",
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.CertificateAuthorityData = attackerCA
			}),
			want:     &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr:  []string{"certificate-authority-data", "SHA-256 " + sha256Hex(bytes.TrimSpace(attackerCA)), "none"},
			notInErr: []string{"BEGIN CERTIFICATE"},
			code:     codes.PermissionDenied,
			is:       errdefs.ErrPermissionDenied,
		},
		{
			// Without a CA the client trusts the system roots, not the
			// cluster's CA.
			name:     "exec info has no CA, the cluster one",
			respond:  respondWithCA(clusterCA),
			in:       execCredential(prodConfig),
			want:     &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr:  []string{"certificate-authority-data", "SHA-256 " + sha256Hex(bytes.TrimSpace(clusterCA)), "none"},
			notInErr: []string{"BEGIN CERTIFICATE"},
			code:     codes.PermissionDenied,
			is:       errdefs.ErrPermissionDenied,
		},
		{
			name:    "exec info skips TLS verification",
			respond: respondWithCA(clusterCA),
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.CertificateAuthorityData = clusterCA
				c.InsecureSkipTLSVerify = true
			}),
			wantErr: []string{"fleet/prod-eu-1", "https://spoke.example:6443", "insecure-skip-tls-verify"},
			code:    codes.PermissionDenied,
			is:      errdefs.ErrPermissionDenied,
		},
		{
			name: "exec info skips TLS verification without a CA",
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.InsecureSkipTLSVerify = true
			}),
			wantErr: []string{"insecure-skip-tls-verify"},
			code:    codes.PermissionDenied,
		},
		{
			name:    "exec info goes through a proxy",
			respond: respondWithCA(clusterCA),
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.CertificateAuthorityData = clusterCA
				c.ProxyURL = "http://u:secret@attacker.example:3128"
			}),
			wantErr:  []string{"fleet/prod-eu-1", "proxy-url", "http://u:xxxxx@attacker.example:3128", "behind a proxy are not supported"},
			notInErr: []string{"secret"},
			code:     codes.PermissionDenied,
			is:       errdefs.ErrPermissionDenied,
		},
		{
			name:    "exec info verifies another TLS server name",
			respond: respondWithCA(clusterCA),
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.CertificateAuthorityData = clusterCA
				c.TLSServerName = "attacker.example"
			}),
			wantErr: []string{"fleet/prod-eu-1", "tls-server-name", "attacker.example", "spoke.example"},
			code:    codes.PermissionDenied,
			is:      errdefs.ErrPermissionDenied,
		},
		{
			name: "every bypass at once is named",
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.InsecureSkipTLSVerify = true
				c.ProxyURL = "http://attacker.example:3128"
				c.TLSServerName = "attacker.example"
			}),
			wantErr: []string{"insecure-skip-tls-verify", "proxy-url", "tls-server-name"},
			code:    codes.PermissionDenied,
		},
		{
			name:    "exec info CA is the cluster's",
			respond: respondWithCA(clusterCA),
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.CertificateAuthorityData = clusterCA
			}),
			want: &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
		},
		{
			name:    "exec info CA is the cluster's but for surrounding white space",
			respond: respondWithCA(append([]byte("\n "), clusterCA...)),
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.CertificateAuthorityData = bytes.TrimSpace(clusterCA)
			}),
			want: &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
		},
		{
			name:    "exec info TLS server name is the server's host",
			respond: respondWithCA(clusterCA),
			in: withCluster(execCredential(prodConfig), func(c *clientauthenticationv1.Cluster) {
				c.CertificateAuthorityData = clusterCA
				c.TLSServerName = "Spoke.Example"
			}),
			want: &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
		},
		{
			// client-go sends the bearer token whatever the scheme: over
			// http anyone on the path reads it.
			name:    "exec info server is plain http, as the broker answers",
			respond: respondWithServer("http://spoke.example:6443"),
			in:      execCredentialFor("http://spoke.example:6443", prodConfig),
			wantErr: []string{"fleet/prod-eu-1", "http://spoke.example:6443", "not an https URL", "cleartext"},
			code:    codes.PermissionDenied,
			is:      errdefs.ErrPermissionDenied,
		},
		{
			name:    "exec info server is plain http in upper case",
			respond: respondWithServer("HTTP://spoke.example"),
			in:      execCredentialFor("HTTP://spoke.example", prodConfig),
			wantErr: []string{"HTTP://spoke.example", "not an https URL"},
			code:    codes.PermissionDenied,
		},
		{
			// Refused before a token is minted, as an http server is.
			name:    "exec info server has no host, as the broker answers",
			respond: respondWithServer("https:///k8s/clusters/c-1"),
			in:      execCredentialFor("https:///k8s/clusters/c-1", prodConfig),
			wantErr: []string{"fleet/prod-eu-1", "https:///k8s/clusters/c-1", "it has no host"},
			code:    codes.PermissionDenied,
			is:      errdefs.ErrPermissionDenied,
		},
		{
			name:     "exec info server has user information, as the broker answers",
			respond:  respondWithServer("https://u:secret@spoke.example:6443"),
			in:       execCredentialFor("https://u:secret@spoke.example:6443", prodConfig),
			wantErr:  []string{"fleet/prod-eu-1", "https://u:xxxxx@spoke.example:6443", "it has user information"},
			notInErr: []string{"secret"},
			code:     codes.PermissionDenied,
			is:       errdefs.ErrPermissionDenied,
		},
		{
			name:    "broker answers a plain http server",
			respond: respondWithServer("http://spoke.example:443"),
			in:      execCredentialFor("https://spoke.example:443", prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"http://spoke.example:443", "from the broker, is unusable", "not an https URL"},
			code:    codes.PermissionDenied,
		},
		{
			name: "broker returns no server",
			respond: func(req *credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
				resp, _ := okResponse(req)
				resp.Server = ""
				return resp, nil
			},
			in:      execCredential(prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"fleet/prod-eu-1", "no server"},
			code:    codes.PermissionDenied,
		},
		{
			name:    "no cluster info",
			in:      clientauthenticationv1.ExecCredential{},
			wantErr: []string{"no ClusterProfile", "--cluster", "client.authentication.k8s.io/exec", "provideClusterInfo"},
		},
		{
			name:    "null config",
			in:      execCredential("null"),
			wantErr: []string{"no ClusterProfile", "--cluster"},
		},
		{
			name:    "cluster info without config",
			in:      execCredential(""),
			wantErr: []string{"no ClusterProfile", "--cluster"},
		},
		{
			name:    "config of the wrong shape",
			in:      execCredential(`{"namespace":"fleet","name":"prod-eu-1"}`),
			wantErr: []string{"spec.cluster.config", `unknown field "namespace"`, `want {"clusterProfile"`},
		},
		{
			name:    "missing token file",
			cfg:     func(c *plugin.Config) { c.TokenFile = filepath.Join(c.TokenFile+".d", "missing") },
			in:      execCredential(prodConfig),
			wantErr: []string{"read hub token", "token.d/missing", "no such file"},
		},
		{
			name:    "broker denies",
			respond: permissionDenied,
			in:      execCredential(prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"exchange for cluster fleet/prod-eu-1: permission denied: system:serviceaccount:apps:ci may not use fleet/prod-eu-1; ", "credbroker.io/allowed-subjects"},
			code:    codes.PermissionDenied,
			is:      errdefs.ErrPermissionDenied,
		},
		{
			name: "token in the broker's message is redacted",
			respond: func(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
				return nil, status.Error(codes.Unauthenticated, "bad token "+testHubToken)
			},
			in:      execCredential(prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"exchange for cluster fleet/prod-eu-1: unauthenticated: bad token [redacted]; ", "--token-file"},
			code:    codes.Unauthenticated,
		},
		{
			name: "broker returns no token",
			respond: func(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
				return &credbrokerv1alpha1.ExchangeResponse{ExpirationTime: timestamppb.New(testExpiry)}, nil
			},
			in:      execCredential(prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"broker returned no token"},
		},
		{
			name: "broker returns no expiration",
			respond: func(*credbrokerv1alpha1.ExchangeRequest) (*credbrokerv1alpha1.ExchangeResponse, error) {
				return &credbrokerv1alpha1.ExchangeResponse{Token: testSpokeToken}, nil
			},
			in:      execCredential(prodConfig),
			want:    &credbrokerv1alpha1.ExchangeRequest{Cluster: objRef("fleet", "prod-eu-1")},
			wantErr: []string{"broker returned no expiration time"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			respond := tt.respond
			if respond == nil {
				respond = okResponse
			}
			b := startBroker(t, respond)
			cfg := plugin.Config{BrokerAddress: b.addr, TLS: b.clientTLS, TokenFile: b.tokenFile, Timeout: 10 * time.Second}
			if tt.cfg != nil {
				tt.cfg(&cfg)
			}
			p, err := plugin.New(cfg)
			require.NoError(t, err)

			st, err := p.GetToken(t.Context(), tt.in)

			got := b.fake.received()
			if tt.want == nil {
				assert.Empty(t, got, "the broker must not be called")
			} else if assert.Len(t, got, 1) {
				assert.True(t, proto.Equal(tt.want, got[0]), "request:\n got %v\nwant %v", got[0], tt.want)
			}
			if tt.wantErr != nil {
				require.Error(t, err)
				for _, s := range tt.wantErr {
					assert.Contains(t, err.Error(), s)
				}
				assert.NotContains(t, err.Error(), testHubToken)
				assert.NotContains(t, err.Error(), testSpokeToken)
				for _, s := range tt.notInErr {
					assert.NotContains(t, err.Error(), s)
				}
				if tt.code != codes.OK {
					assert.Equal(t, tt.code, errdefs.Code(err))
				}
				if tt.is != nil {
					assert.ErrorIs(t, err, tt.is)
				}
				assert.Empty(t, st.Token)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, testSpokeToken, st.Token)
			require.NotNil(t, st.ExpirationTimestamp)
			assert.True(t, testExpiry.Equal(st.ExpirationTimestamp.Time), "expiry %v, want %v", st.ExpirationTimestamp, testExpiry)
		})
	}
}

// TestGetTokenRereadsTokenFile checks that a token the kubelet rotated is
// used on the next call.
func TestGetTokenRereadsTokenFile(t *testing.T) {
	b := startBroker(t, okResponse)
	p, err := plugin.New(plugin.Config{BrokerAddress: b.addr, TLS: b.clientTLS, TokenFile: b.tokenFile})
	require.NoError(t, err)

	_, err = p.GetToken(t.Context(), execCredential(prodConfig))
	require.NoError(t, err)

	const rotated = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJyb3RhdGVkIn0.c2lnMg"
	b.fake.setHubToken(rotated)
	require.NoError(t, testpki.WriteFileAtomic(b.tokenFile, []byte(rotated), 0o600))
	_, err = p.GetToken(t.Context(), execCredential(prodConfig))
	require.NoError(t, err)
	assert.Len(t, b.fake.received(), 2)
}

func TestGetTokenBadTokenFile(t *testing.T) {
	tests := []struct {
		name    string
		content string
		wantErr string
	}{
		{name: "empty", content: " \n", wantErr: "is empty"},
		{name: "two tokens", content: "a.b.c d.e.f", wantErr: "does not hold a bearer token"},
		{name: "too large", content: string(make([]byte, 20<<10)), wantErr: "more than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := startBroker(t, okResponse)
			require.NoError(t, os.WriteFile(b.tokenFile, []byte(tt.content), 0o600))
			p, err := plugin.New(plugin.Config{BrokerAddress: b.addr, TLS: b.clientTLS, TokenFile: b.tokenFile})
			require.NoError(t, err)
			_, err = p.GetToken(t.Context(), execCredential(prodConfig))
			require.ErrorContains(t, err, tt.wantErr)
			assert.Contains(t, err.Error(), b.tokenFile)
			assert.Empty(t, b.fake.received())
		})
	}
}

// TestGetTokenBrokerUnreachable covers a refused connection, a broker that
// never answers, and a broker whose certificate the client does not trust.
func TestGetTokenBrokerUnreachable(t *testing.T) {
	refused := func(t *testing.T) string {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		addr := lis.Addr().String()
		require.NoError(t, lis.Close())
		return addr
	}
	// silent accepts connections and never says a word.
	silent := func(t *testing.T) string {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		var (
			mu    sync.Mutex
			conns []net.Conn
		)
		go func() {
			for {
				c, err := lis.Accept()
				if err != nil {
					return
				}
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
			}
		}()
		t.Cleanup(func() {
			_ = lis.Close()
			mu.Lock()
			defer mu.Unlock()
			for _, c := range conns {
				_ = c.Close()
			}
		})
		return lis.Addr().String()
	}

	tests := []struct {
		name    string
		addr    func(t *testing.T) string
		timeout time.Duration
		// otherCA makes the client trust a CA that did not sign the broker.
		otherCA bool
		code    codes.Code
		wantErr []string
	}{
		{
			name:    "connection refused",
			addr:    refused,
			timeout: 5 * time.Second,
			code:    codes.Unavailable,
			wantErr: []string{"exchange for cluster fleet/prod-eu-1: unavailable:", "connection refused", "timeout 5s", "check --broker-address and --ca-file"},
		},
		{
			name:    "silent broker",
			addr:    silent,
			timeout: 500 * time.Millisecond,
			code:    codes.DeadlineExceeded,
			wantErr: []string{"exchange for cluster fleet/prod-eu-1: deadline exceeded:", "timeout 500ms", "raise --timeout"},
		},
		{
			name:    "untrusted broker certificate",
			timeout: 5 * time.Second,
			otherCA: true,
			code:    codes.Unavailable,
			wantErr: []string{"exchange for cluster fleet/prod-eu-1: unavailable:", "certificate"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := startBroker(t, okResponse)
			addr, clientTLS := b.addr, b.clientTLS
			if tt.addr != nil {
				addr = tt.addr(t)
			}
			if tt.otherCA {
				other, err := testpki.NewCA("other.test")
				require.NoError(t, err)
				pool := x509.NewCertPool()
				pool.AddCert(other.Certificate())
				clientTLS = &tls.Config{RootCAs: pool}
			}
			p, err := plugin.New(plugin.Config{BrokerAddress: addr, TLS: clientTLS, TokenFile: b.tokenFile, Timeout: tt.timeout})
			require.NoError(t, err)

			start := time.Now()
			_, err = p.GetToken(t.Context(), execCredential(prodConfig))
			elapsed := time.Since(start)

			require.Error(t, err)
			t.Logf("GetToken error after %v: %v", elapsed, err)
			assert.Equal(t, tt.code, errdefs.Code(err), "error: %v", err)
			for _, s := range tt.wantErr {
				assert.Contains(t, err.Error(), s)
			}
			assert.NotContains(t, err.Error(), testHubToken)
			assert.Less(t, elapsed, tt.timeout+time.Second, "GetToken must return within its timeout")
			assert.Empty(t, b.fake.received())
		})
	}
}

func TestGetTokenHonoursCallerContext(t *testing.T) {
	b := startBroker(t, okResponse)
	p, err := plugin.New(plugin.Config{BrokerAddress: b.addr, TLS: b.clientTLS, TokenFile: b.tokenFile})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err = p.GetToken(ctx, execCredential(prodConfig))
	assert.Equal(t, codes.Canceled, errdefs.Code(err), "error: %v", err)
}

func TestNew(t *testing.T) {
	valid := func() plugin.Config {
		return plugin.Config{BrokerAddress: "broker.example:8443", TLS: &tls.Config{}, TokenFile: "/token"}
	}
	tests := []struct {
		name    string
		mutate  func(*plugin.Config)
		wantErr string
	}{
		{name: "minimal", mutate: func(*plugin.Config) {}},
		{name: "everything", mutate: func(c *plugin.Config) {
			c.BrokerAddress = "[::1]:443"
			c.Cluster = ref("fleet", "prod")
			c.ServiceAccount = ref("apps", "deployer")
			c.Audiences = []string{"a", "b"}
			c.ExpirationSeconds = 600
			c.Timeout = time.Minute
			c.MaxRetryWait = time.Minute
		}},
		{name: "no address", mutate: func(c *plugin.Config) { c.BrokerAddress = "" }, wantErr: "broker address is required"},
		{name: "address without port", mutate: func(c *plugin.Config) { c.BrokerAddress = "broker.example" }, wantErr: "not host:port"},
		{name: "address without host", mutate: func(c *plugin.Config) { c.BrokerAddress = ":443" }, wantErr: "has no host"},
		{name: "address with bad port", mutate: func(c *plugin.Config) { c.BrokerAddress = "broker:https" }, wantErr: "invalid port"},
		{name: "address with port 0", mutate: func(c *plugin.Config) { c.BrokerAddress = "broker:0" }, wantErr: "invalid port"},
		{name: "no TLS", mutate: func(c *plugin.Config) { c.TLS = nil }, wantErr: "TLS config for the broker is required"},
		{name: "TLS skips verification", mutate: func(c *plugin.Config) { c.TLS.InsecureSkipVerify = true }, wantErr: "InsecureSkipVerify"},
		{name: "no token file", mutate: func(c *plugin.Config) { c.TokenFile = "" }, wantErr: "token file is required"},
		{name: "bad cluster", mutate: func(c *plugin.Config) { c.Cluster = ref("Fleet", "prod") }, wantErr: "cluster: namespace"},
		{name: "bad service account", mutate: func(c *plugin.Config) { c.ServiceAccount = ref("apps", "") }, wantErr: "service account: name is required"},
		{name: "empty audience", mutate: func(c *plugin.Config) { c.Audiences = []string{"a", ""} }, wantErr: "audience"},
		{name: "negative expiration", mutate: func(c *plugin.Config) { c.ExpirationSeconds = -1 }, wantErr: "negative"},
		{name: "negative timeout", mutate: func(c *plugin.Config) { c.Timeout = -time.Second }, wantErr: "negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := valid()
			tt.mutate(&cfg)
			p, err := plugin.New(cfg)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				assert.Nil(t, p)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, plugin.Name, p.Name())
		})
	}
}
