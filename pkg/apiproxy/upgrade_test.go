package apiproxy

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/types"
	agentpb "sigs.k8s.io/apiserver-network-proxy/proto/agent"

	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The konnectivity parts are real (the broker's Router, the agent's
// Backend, over gRPC on loopback); the agent's identity, the grants and
// the upstream's offer are the fakes below. envtest runs no kubelet, so the
// upgraded connections of exec, attach and port-forward are exercised here
// against an upgrade server in the API server's place.

var testCluster = fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "private"}, UID: "uid-1"}

type fakeAdmitter struct{}

func (fakeAdmitter) Admit(context.Context) (fleet.Admission, error) {
	return fleet.Admission{
		Agent:   spiffeid.RequireFromString("spiffe://fleet.test/clusterprofile/fleet/private"),
		Cluster: testCluster, Expires: time.Now().Add(time.Hour),
	}, nil
}
func (fakeAdmitter) Readmit(fleet.Admission) error { return nil }

// fakeGrants holds one grant, of the token "tok", until revoked.
type fakeGrants struct{ revoked atomic.Bool }

const testToken = "tok"

func (g *fakeGrants) Live(id string) (*pb.Grant, bool) {
	if g.revoked.Load() || id != token.ID(testToken) {
		return nil, false
	}
	sum := sha256.Sum256([]byte(testToken))
	return &pb.Grant{
		CredentialId: id, Cluster: &pb.ObjectReference{Namespace: testCluster.Namespace, Name: testCluster.Name},
		ClusterUid: string(testCluster.UID), Subject: &pb.Subject{Username: "consumer"}, TokenSha256: sum[:],
	}, true
}

type fakeUpstreams struct{ up Upstream }

func (u fakeUpstreams) Upstream(types.NamespacedName) (Upstream, error) { return u.up, nil }

// upgradeServer stands for the API server: it switches a request with an
// Upgrade header to that protocol and echoes every line back. It keeps the
// headers of the last request in last.
func upgradeServer(t *testing.T) *httptest.Server {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		lastHeaders.Store(r.Header.Clone())
		proto := r.Header.Get("Upgrade")
		if proto == "" {
			fmt.Fprint(w, "plain")
			return
		}
		conn, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		fmt.Fprintf(rw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", proto)
		_ = rw.Flush()
		for {
			line, err := rw.ReadString('\n')
			if err != nil {
				return
			}
			_, _ = rw.WriteString(line)
			_ = rw.Flush()
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// dataPath starts a Router, a Backend connected to it and a Proxy in front,
// with upstream standing for the spoke API server, and returns the
// proxy's address and its grants.
func dataPath(t *testing.T, upstream *httptest.Server) (string, *fakeGrants) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	router, err := NewRouter(RouterConfig{Admitter: fakeAdmitter{}, ServerID: "test", Log: logr.Discard()})
	require.NoError(t, err)
	go func() { _ = router.Run(ctx) }()
	agents := grpc.NewServer()
	agentpb.RegisterAgentServiceServer(agents, router)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = agents.Serve(lis) }()
	t.Cleanup(agents.Stop)

	backend, err := NewBackend(BackendConfig{
		Credentials: insecure.NewCredentials(), APIServer: upstream.Listener.Addr().String(), Log: logr.Discard(),
	})
	require.NoError(t, err)
	go backend.Serve(ctx, lis.Addr().String())
	require.Eventually(t, func() bool { return router.Carriers(testCluster) == 1 }, 10*time.Second, 10*time.Millisecond)

	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: upstream.Certificate().Raw})
	grants := &fakeGrants{}
	proxy, err := NewProxy(ProxyConfig{
		Dialer: router, Grants: grants,
		Upstreams:       fakeUpstreams{Upstream{Cluster: testCluster, ServerName: "127.0.0.1", CAData: ca}},
		RecheckInterval: 20 * time.Millisecond,
		Audit:           logr.Discard(),
	})
	require.NoError(t, err)
	front := httptest.NewServer(proxy)
	t.Cleanup(front.Close)
	return front.Listener.Addr().String(), grants
}

// upgrade sends an upgrade request for proto through the proxy at addr and
// returns the connection once it switched, with its reader.
func upgrade(t *testing.T, addr, proto string) (net.Conn, *bufio.Reader) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: broker\r\nAuthorization: Bearer %s\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n",
		URL("", testCluster.NamespacedName)+"/api/v1/namespaces/default/pods/p/exec", testToken, proto)
	r := bufio.NewReader(conn)
	resp, err := http.ReadResponse(r, nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusSwitchingProtocols, resp.StatusCode)
	assert.Equal(t, proto, resp.Header.Get("Upgrade"))
	return conn, r
}

var lastHeaders atomic.Value // http.Header

// The spoke sees the token that the proxy checked, and no other: a
// Connection header that names Authorization as hop-by-hop, and a bearer
// in a WebSocket subprotocol (which kube-apiserver accepts), would have
// sent it the token of someone else, under the consumer's audit line.
func TestProxyForwardsOnlyTheCheckedToken(t *testing.T) {
	addr, _ := dataPath(t, upgradeServer(t))
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: broker\r\nAuthorization: Bearer %s\r\nConnection: Upgrade, Authorization\r\n"+
		"Upgrade: websocket\r\nSec-WebSocket-Protocol: v5.channel.k8s.io, %sc3RvbGVu\r\n\r\n",
		URL("", testCluster.NamespacedName)+"/api/v1/namespaces/default/pods/p/exec", testToken, webSocketBearerPrefix)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err)
	require.Equal(t, http.StatusSwitchingProtocols, resp.StatusCode)
	got, _ := lastHeaders.Load().(http.Header)
	require.NotNil(t, got)
	assert.Equal(t, "Bearer "+testToken, got.Get("Authorization"), "the spoke did not get the checked token")
	assert.Equal(t, "v5.channel.k8s.io", got.Get("Sec-WebSocket-Protocol"), "a bearer subprotocol reached the spoke")
}

// The spoke's audit log names the consumer's own address: kube-apiserver
// takes a request's source IPs from X-Forwarded-For, then X-Real-Ip, then
// the connection, so a consumer's X-Real-Ip would have come first there.
func TestProxyTellsTheSpokeTheConsumersAddress(t *testing.T) {
	addr, _ := dataPath(t, upgradeServer(t))
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+URL("", testCluster.NamespacedName)+"/api", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+testToken)
	req.Header.Set("X-Real-Ip", "203.0.113.9")
	req.Header.Set("X-Forwarded-For", "198.51.100.7")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	got, _ := lastHeaders.Load().(http.Header)
	require.NotNil(t, got)
	assert.Empty(t, got.Values("X-Real-Ip"), "the consumer's X-Real-Ip reached the spoke")
	assert.Equal(t, []string{"127.0.0.1"}, got.Values("X-Forwarded-For"))
}

// exec, attach and port-forward switch to WebSocket (kubectl 1.31 and
// later) or SPDY; the proxy carries both ways of the switched connection.
func TestUpgradedConnections(t *testing.T) {
	addr, _ := dataPath(t, upgradeServer(t))
	for _, proto := range []string{"websocket", "SPDY/3.1"} {
		t.Run(proto, func(t *testing.T) {
			conn, r := upgrade(t, addr, proto)
			for i := range 3 {
				line := fmt.Sprintf("frame %d of %s\n", i, proto)
				_, err := io.WriteString(conn, line)
				require.NoError(t, err)
				got, err := r.ReadString('\n')
				require.NoError(t, err)
				assert.Equal(t, line, got)
			}
		})
	}
}

// A revoke ends an upgraded connection in flight, at the next recheck.
func TestRevokeEndsAnUpgradedConnection(t *testing.T) {
	addr, grants := dataPath(t, upgradeServer(t))
	conn, r := upgrade(t, addr, "websocket")
	_, err := io.WriteString(conn, "before\n")
	require.NoError(t, err)
	got, err := r.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "before\n", got)

	grants.revoked.Store(true)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
	// Until the recheck, the echo goes on; then the proxy closes the
	// connection.
	for err == nil {
		_, _ = io.WriteString(conn, "after\n")
		_, err = r.ReadString('\n')
	}
	assert.ErrorIs(t, err, io.EOF, "the connection did not close after the revoke")
}
