package apiproxy

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/types"
	clientpb "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"
)

func TestParsePath(t *testing.T) {
	for _, tt := range []struct {
		path, rest string
		cluster    types.NamespacedName
		ok         bool
	}{
		{path: "/clusters/fleet/spoke-1/api/v1/namespaces", cluster: types.NamespacedName{Namespace: "fleet", Name: "spoke-1"}, rest: "/api/v1/namespaces", ok: true},
		{path: "/clusters/fleet/spoke-1", cluster: types.NamespacedName{Namespace: "fleet", Name: "spoke-1"}, rest: "/", ok: true},
		{path: "/clusters/fleet/spoke.example.com/version", cluster: types.NamespacedName{Namespace: "fleet", Name: "spoke.example.com"}, rest: "/version", ok: true},
		{path: "/api/v1/namespaces"},
		{path: "/clusters/"},
		{path: "/clusters/fleet"},
		{path: "/clusters/fleet/"},
		{path: "/clusters//spoke-1/api"},
		{path: "/clusters/Fleet/spoke-1/api"},
		{path: "/clusters/fleet/../api"},
		{path: "/clusters/fleet/spoke_1/api"},
		{path: "/clusters/" + strings.Repeat("a", 64) + "/spoke/api"},
	} {
		t.Run(tt.path, func(t *testing.T) {
			cluster, rest, err := ParsePath(tt.path)
			if !tt.ok {
				require.Error(t, err)
				assert.Contains(t, err.Error(), "/clusters/<namespace>/<name>/")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.cluster, cluster)
			assert.Equal(t, tt.rest, rest)
		})
	}
}

func FuzzParsePath(f *testing.F) {
	for _, s := range []string{"/clusters/fleet/spoke-1/api", "/clusters//", "/clusters/a/b/../../c", "/clusters/%2F/x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, path string) {
		cluster, rest, err := ParsePath(path)
		if err != nil {
			return
		}
		// What it accepts is the ClusterProfile's prefix and the rest.
		prefix := URL("", cluster)
		if prefix+rest != path && (prefix != path || rest != "/") {
			t.Fatalf("ParsePath(%q) = %v, %q", path, cluster, rest)
		}
	})
}

func TestBearerOf(t *testing.T) {
	for _, tt := range []struct {
		name   string
		values []string
		want   string
		ok     bool
	}{
		{name: "bearer", values: []string{"Bearer abc"}, want: "abc", ok: true},
		{name: "scheme in lower case", values: []string{"bearer abc"}, want: "abc", ok: true},
		{name: "none"},
		{name: "basic", values: []string{"Basic YTpi"}},
		{name: "empty token", values: []string{"Bearer "}},
		{name: "two headers", values: []string{"Bearer abc", "Bearer def"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r, err := http.NewRequest(http.MethodGet, "/", nil)
			require.NoError(t, err)
			for _, v := range tt.values {
				r.Header.Add("Authorization", v)
			}
			got, ok := bearerOf(r)
			assert.Equal(t, tt.ok, ok)
			assert.Equal(t, tt.want, got)
		})
	}
}

// The agent connects the broker's dials to its API server only.
func TestBackendDialsOnlyTheAPIServer(t *testing.T) {
	b := &Backend{cfg: BackendConfig{APIServer: "10.96.0.1:443", Log: logr.Discard()}}
	for _, tt := range []struct {
		protocol, address         string
		wantProtocol, wantAddress string
	}{
		{"tcp", APIServerAddress, "tcp", "10.96.0.1:443"},
		{"tcp", "10.0.0.5:22", "unix", ""},
		{"tcp", "kubernetes.default.svc:443", "unix", ""},
		{"udp", APIServerAddress, "unix", ""},
		{"unix", "/var/run/docker.sock", "unix", ""},
	} {
		req := &clientpb.DialRequest{Protocol: tt.protocol, Address: tt.address}
		b.restrict(req)
		assert.Equal(t, tt.wantProtocol, req.GetProtocol(), "%s %s", tt.protocol, tt.address)
		assert.Equal(t, tt.wantAddress, req.GetAddress(), "%s %s", tt.protocol, tt.address)
	}
}

// Anyone may send any path: a refused request labels the metrics with no
// ClusterProfile, so random names cannot grow them.
func TestRefusedRequestsLabelNoClusterProfile(t *testing.T) {
	reg := prometheus.NewRegistry()
	_, err := NewProxy(ProxyConfig{
		Dialer: nil, Grants: &fakeGrants{}, Upstreams: fakeUpstreams{}, Registerer: reg,
		Audit: logr.Discard(),
	})
	require.Error(t, err, "a proxy without a Dialer")
	p, err := NewProxy(ProxyConfig{
		Dialer: &Router{}, Grants: &fakeGrants{}, Upstreams: fakeUpstreams{}, Registerer: reg,
		Audit: logr.Discard(),
	})
	require.NoError(t, err)
	for i := range 50 {
		w := httptest.NewRecorder()
		r := httptest.NewRequest(http.MethodGet, fmt.Sprintf("/clusters/ns-%d/name-%d/api", i, i), nil)
		if i%2 == 0 {
			r.Header.Set("Authorization", "Bearer not-minted")
		}
		p.ServeHTTP(w, r)
		require.Equal(t, http.StatusUnauthorized, w.Code)
	}
	assert.Equal(t, 1, testutil.CollectAndCount(p.metrics.requests), "series of credbroker_apiproxy_requests_total")
	assert.Equal(t, 50.0, testutil.ToFloat64(p.metrics.requests.WithLabelValues("", "401")))
}
