package identity_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/credbroker/credbroker/internal/testing/fakeworkload"
	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/identity"
)

func startWorkloadAPI(t *testing.T) *fakeworkload.Server {
	t.Helper()
	api, err := fakeworkload.Start()
	require.NoError(t, err)
	t.Cleanup(api.Stop)
	return api
}

func issue(t *testing.T, ca *testpki.CA, id string) fakeworkload.SVID {
	t.Helper()
	cert, key, err := ca.IssueSVID(id, time.Hour)
	require.NoError(t, err)
	return fakeworkload.SVID{CertPEM: cert, KeyPEM: key}
}

func newWorkloadSource(t *testing.T, api *fakeworkload.Server, id spiffeid.ID, log *logRecorder) (*identity.WorkloadSource, error) {
	t.Helper()
	cfg := identity.WorkloadSourceConfig{Address: api.Addr(), TrustDomain: td, ID: id, Wait: 5 * time.Second}
	if log != nil {
		cfg.Log = log.logger()
	}
	src, err := identity.NewWorkloadSource(context.Background(), cfg)
	if err == nil {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = src.Run(ctx)
		}()
		t.Cleanup(func() { cancel(); <-done })
	}
	return src, err
}

// Attack: the Workload API serves this process an SVID for another ID
// than the one it must have (SPIRE serves every entry whose selectors match,
// so a broker's pod can be handed an agent's identity, or the reverse). The
// source must not present it.
func TestWorkloadSourceRefusesAnotherID(t *testing.T) {
	ca := newCA(t, td.Name())
	other := "spiffe://" + td.Name() + "/clusterprofile/fleet/other"
	tests := []struct {
		name    string
		served  []string
		want    string
		wantErr string
	}{
		{name: "only another ID", served: []string{other}, wantErr: "serves no X.509-SVID for " + brokerID + "; it serves [" + other + "]"},
		{name: "another ID first", served: []string{other, brokerID}, want: brokerID},
		{name: "another trust domain", served: []string{"spiffe://elsewhere.test/broker"}, wantErr: "serves no X.509-SVID for " + brokerID},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			api := startWorkloadAPI(t)
			var svids []fakeworkload.SVID
			for _, id := range tt.served {
				svids = append(svids, issue(t, ca, id))
			}
			require.NoError(t, api.Set(ca.BundlePEM(), svids...))
			src, err := newWorkloadSource(t, api, spiffeid.RequireFromString(brokerID), nil)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			svid, err := src.GetX509SVID()
			require.NoError(t, err)
			assert.Equal(t, tt.want, svid.ID.String())
		})
	}
}

// Attack: after the process has its SVID, the Workload API rotates it to
// one for another ID. The source keeps the SVID it has, and says why.
func TestWorkloadSourceKeepsItsIDOnRotation(t *testing.T) {
	ca := newCA(t, td.Name())
	api := startWorkloadAPI(t)
	require.NoError(t, api.Set(ca.BundlePEM(), issue(t, ca, brokerID)))
	log := &logRecorder{}
	src, err := newWorkloadSource(t, api, spiffeid.RequireFromString(brokerID), log)
	require.NoError(t, err)
	first, err := src.GetX509SVID()
	require.NoError(t, err)

	require.NoError(t, api.Set(ca.BundlePEM(), issue(t, ca, "spiffe://"+td.Name()+"/clusterprofile/fleet/other")))
	waitForError(t, log, "serves no X.509-SVID for "+brokerID)
	svid, err := src.GetX509SVID()
	require.NoError(t, err)
	assert.Same(t, first, svid, "the source keeps the SVID of its own ID")
}

// Without an expected ID the source takes the first SVID of its trust
// domain.
func TestWorkloadSourceWithoutID(t *testing.T) {
	ca := newCA(t, td.Name())
	api := startWorkloadAPI(t)
	agent := "spiffe://" + td.Name() + "/clusterprofile/fleet/east"
	require.NoError(t, api.Set(ca.BundlePEM(), issue(t, ca, "spiffe://elsewhere.test/x"), issue(t, ca, agent)))
	src, err := newWorkloadSource(t, api, spiffeid.ID{}, nil)
	require.NoError(t, err)
	svid, err := src.GetX509SVID()
	require.NoError(t, err)
	assert.Equal(t, agent, svid.ID.String())
}

// A rotation pushed by the Workload API reaches GetX509SVID, OnChange and
// SVIDChanges, and is logged at V(1) with the ID; the bundle of another
// trust domain is never served.
func TestWorkloadSourceRotation(t *testing.T) {
	ca := newCA(t, td.Name())
	api := startWorkloadAPI(t)
	require.NoError(t, api.Set(ca.BundlePEM(), issue(t, ca, brokerID)))
	log := &logRecorder{}
	src, err := newWorkloadSource(t, api, spiffeid.RequireFromString(brokerID), log)
	require.NoError(t, err)
	var changes, rotations atomic.Int32
	src.OnChange(func() { changes.Add(1) })
	identity.SVIDChanges(src, func(*x509svid.SVID) { rotations.Add(1) })
	first, err := src.GetX509SVID()
	require.NoError(t, err)

	require.NoError(t, api.Set(ca.BundlePEM(), issue(t, ca, brokerID)))
	require.Eventually(t, func() bool { return rotations.Load() == 1 }, 5*time.Second, pollInterval)
	assert.GreaterOrEqual(t, changes.Load(), int32(1))
	svid, err := src.GetX509SVID()
	require.NoError(t, err)
	assert.NotEqual(t, first.Certificates[0].SerialNumber, svid.Certificates[0].SerialNumber)
	assert.True(t, log.hasInfo("Workload API update id "+brokerID), "the update is logged with its SPIFFE ID")

	bundle, err := src.GetX509BundleForTrustDomain(td)
	require.NoError(t, err)
	assert.True(t, bundle.HasX509Authority(ca.Certificate()))
	_, err = src.GetX509BundleForTrustDomain(spiffeid.RequireTrustDomainFromString("elsewhere.test"))
	require.Error(t, err)
}

// No answer from the Workload API: NewWorkloadSource gives up after Wait
// with an error that says where it looked.
func TestWorkloadSourceNoAnswer(t *testing.T) {
	api := startWorkloadAPI(t)
	_, err := identity.NewWorkloadSource(context.Background(), identity.WorkloadSourceConfig{
		Address: api.Addr(), TrustDomain: td, Wait: 200 * time.Millisecond,
	})
	require.ErrorContains(t, err, "no X.509-SVID from the Workload API at "+api.Addr()+" within 200ms")
}

// Any one of the files next to a socket is ambiguous, whichever it is.
func TestNewSourceNeedsOneKind(t *testing.T) {
	tests := []struct {
		name string
		cfg  identity.SourceConfig
	}{
		{name: "certificate", cfg: identity.SourceConfig{CertFile: "c"}},
		{name: "key", cfg: identity.SourceConfig{KeyFile: "k"}},
		{name: "bundle", cfg: identity.SourceConfig{BundleFile: "b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := tt.cfg
			// A short Wait, so that a source that did try the socket fails fast.
			cfg.EndpointSocket, cfg.TrustDomain, cfg.Wait = "unix:///x.sock", td, time.Millisecond
			_, err := identity.NewSource(context.Background(), cfg)
			require.ErrorContains(t, err, "either the Workload API socket or the SVID and bundle files, not both")
		})
	}
}

// A zero Wait means DefaultWait, not "give up at once": a source built
// from flags left at zero still gets its SVID.
func TestWorkloadSourceZeroWaitIsTheDefault(t *testing.T) {
	ca := newCA(t, td.Name())
	api := startWorkloadAPI(t)
	require.NoError(t, api.Set(ca.BundlePEM(), issue(t, ca, brokerID)))
	src, err := identity.NewWorkloadSource(context.Background(), identity.WorkloadSourceConfig{
		Address: api.Addr(), TrustDomain: td, ID: spiffeid.RequireFromString(brokerID),
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = src.Close() })
	svid, err := src.GetX509SVID()
	require.NoError(t, err)
	assert.Equal(t, brokerID, svid.ID.String())
}

// CheckSourceChoice judges the flags of the broker and the agent: exactly
// one source, and a whole one.
func TestCheckSourceChoice(t *testing.T) {
	tests := []struct {
		name                    string
		socket, cert, key, bndl string
		wantErr                 string
	}{
		{name: "socket", socket: "unix:///run/spire/agent.sock"},
		{name: "files", cert: "c", key: "k", bndl: "b"},
		{name: "socket and a certificate", socket: "unix:///run/spire/agent.sock", cert: "c", wantErr: "not both"},
		{name: "socket and a key", socket: "unix:///run/spire/agent.sock", key: "k", wantErr: "not both"},
		{name: "socket and a bundle", socket: "unix:///run/spire/agent.sock", bndl: "b", wantErr: "not both"},
		{name: "unusable socket", socket: "http://spire", wantErr: `the Workload API socket (--spiffe-endpoint-socket) "http://spire"`},
		{name: "nothing", wantErr: "an SVID source is required"},
		{name: "no certificate", key: "k", bndl: "b", wantErr: "an SVID source is required"},
		{name: "no key", cert: "c", bndl: "b", wantErr: "an SVID source is required"},
		{name: "no bundle", cert: "c", key: "k", wantErr: "an SVID source is required"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := identity.CheckSourceChoice(tt.socket, tt.cert, tt.key, tt.bndl)
			if tt.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.wantErr)
		})
	}
}

// NewSource builds the source its config names.
func TestNewSourcePicksTheKind(t *testing.T) {
	ca := newCA(t, td.Name())

	vol := newProjectedDir(t)
	vol.write(svidFiles(t, ca, agentID, ca))
	src, err := identity.NewSource(context.Background(), identity.SourceConfig{
		CertFile: vol.path("tls.crt"), KeyFile: vol.path("tls.key"), BundleFile: vol.path("ca.crt"), TrustDomain: td,
	})
	require.NoError(t, err)
	assert.IsType(t, &identity.FileSource{}, src)

	api := startWorkloadAPI(t)
	require.NoError(t, api.Set(ca.BundlePEM(), issue(t, ca, brokerID)))
	src, err = identity.NewSource(context.Background(), identity.SourceConfig{
		EndpointSocket: api.Addr(), TrustDomain: td, Wait: 5 * time.Second,
	})
	require.NoError(t, err)
	require.IsType(t, &identity.WorkloadSource{}, src)
	t.Cleanup(func() { _ = src.(*identity.WorkloadSource).Close() })
}
