package grants

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants/selector"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// fakeConfigMaps is one namespace's ConfigMaps, with resourceVersions, and
// the failures a test asks for.
type fakeConfigMaps struct {
	mu  sync.Mutex
	cms map[string]*corev1.ConfigMap
	rv  int
	// conflicts fails that many writes with a Conflict; fail fails every
	// call with it.
	conflicts int
	fail      error
	writes    int
}

var configMapsResource = schema.GroupResource{Resource: "configmaps"}

func (f *fakeConfigMaps) Get(_ context.Context, name string, _ metav1.GetOptions) (*corev1.ConfigMap, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return nil, f.fail
	}
	cm, ok := f.cms[name]
	if !ok {
		return nil, apierrors.NewNotFound(configMapsResource, name)
	}
	return cm.DeepCopy(), nil
}

func (f *fakeConfigMaps) write(cm *corev1.ConfigMap, create bool) (*corev1.ConfigMap, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return nil, f.fail
	}
	old, exists := f.cms[cm.Name]
	switch {
	case f.conflicts > 0:
		f.conflicts--
		return nil, apierrors.NewConflict(configMapsResource, cm.Name, errors.New("changed"))
	case create && exists:
		return nil, apierrors.NewAlreadyExists(configMapsResource, cm.Name)
	case !create && (!exists || old.ResourceVersion != cm.ResourceVersion):
		return nil, apierrors.NewConflict(configMapsResource, cm.Name, errors.New("changed"))
	}
	f.rv++
	f.writes++
	cm = cm.DeepCopy()
	cm.ResourceVersion = strconv.Itoa(f.rv)
	if f.cms == nil {
		f.cms = map[string]*corev1.ConfigMap{}
	}
	f.cms[cm.Name] = cm
	return cm.DeepCopy(), nil
}

func (f *fakeConfigMaps) Create(_ context.Context, cm *corev1.ConfigMap, _ metav1.CreateOptions) (*corev1.ConfigMap, error) {
	return f.write(cm, true)
}

func (f *fakeConfigMaps) Update(_ context.Context, cm *corev1.ConfigMap, _ metav1.UpdateOptions) (*corev1.ConfigMap, error) {
	return f.write(cm, false)
}

func (f *fakeConfigMaps) data() map[string]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if cm, ok := f.cms[DefaultPendingConfigMap]; ok {
		return cm.Data
	}
	return nil
}

// handlerInformer hands the store's handler to the test.
type handlerInformer struct{ handler cache.ResourceEventHandler }

func (f *handlerInformer) AddEventHandler(h cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error) {
	f.handler = h
	return nil, nil
}
func (f *handlerInformer) HasSynced() bool       { return true }
func (f *handlerInformer) GetStore() cache.Store { return nil }

var pendingStart = time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)

func newTestStore(t *testing.T, cms *fakeConfigMaps, maxBytes int) (*PendingStore, *handlerInformer, *clocktesting.FakePassiveClock) {
	t.Helper()
	inf := &handlerInformer{}
	clk := clocktesting.NewFakePassiveClock(pendingStart)
	s, err := NewPendingStore(PendingStoreConfig{
		ConfigMaps: cms, Namespace: "credbroker-system", Informer: inf,
		MaxLifetime: time.Hour, MaxBytes: maxBytes, Clock: clk,
	})
	require.NoError(t, err)
	return s, inf, clk
}

func pendingGrant(id, cluster string, expires time.Duration) *pb.Grant {
	return &pb.Grant{
		CredentialId: id, Cluster: &pb.ObjectReference{Namespace: "fleet", Name: cluster}, ClusterUid: "uid-" + cluster,
		ExpirationTime: timestamppb.New(pendingStart.Add(expires)),
	}
}

// A recorded revoke reaches the other replicas' handlers as it was
// written, with its expiry bounded by the longest token lifetime, and
// expired and unreadable records are dropped at the next write.
func TestPendingStoreRecordAndObserve(t *testing.T) {
	cms := &fakeConfigMaps{}
	s, inf, clk := newTestStore(t, cms, 0)
	var seen []PendingRevoke
	s.OnChange(func(p []PendingRevoke) { seen = p })

	require.NoError(t, s.Record(t.Context(), []PendingRevoke{
		{Grant: pendingGrant("JTI=a", "one", 10*time.Minute), Reason: "leaked"},
		{Grant: pendingGrant("JTI=b", "two", 100*time.Hour), Reason: "gone"},
		{Grant: pendingGrant("JTI=expired", "two", -time.Minute)},
		{Grant: &pb.Grant{}},
	}))
	data := cms.data()
	require.Len(t, data, 2)
	for _, v := range data {
		assert.NotContains(t, v, "eyJ", "a record holds something shaped like a token")
	}
	inf.handler.OnAdd(cms.cms[DefaultPendingConfigMap].DeepCopy(), false)
	require.Len(t, seen, 2)
	byID := map[string]PendingRevoke{}
	for _, p := range seen {
		byID[p.Grant.GetCredentialId()] = p
	}
	assert.Equal(t, "leaked", byID["JTI=a"].Reason)
	assert.Equal(t, fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "one"}, UID: "uid-one"}, ClusterRef(byID["JTI=a"].Grant))
	assert.Equal(t, pendingStart.Add(10*time.Minute), byID["JTI=a"].Grant.GetExpirationTime().AsTime())
	assert.Equal(t, pendingStart.Add(time.Hour), byID["JTI=b"].Grant.GetExpirationTime().AsTime(), "an expiry past the longest token lifetime")

	// A hand-edited record and an expired one go at the next write.
	cm := cms.cms[DefaultPendingConfigMap]
	cm.Data["junk"] = "not json"
	cm.Data[pendingKey("JTI=c")] = `{"credentialID":"JTI=other","cluster":"fleet/one","expires":"2030-01-01T00:00:00Z"}`
	inf.handler.OnUpdate(nil, cm.DeepCopy())
	assert.Len(t, seen, 2, "unreadable records are not revokes")
	clk.SetTime(pendingStart.Add(11 * time.Minute))
	require.NoError(t, s.Record(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=d", "one", 30*time.Minute)}}))
	assert.ElementsMatch(t, []string{pendingKey("JTI=b"), pendingKey("JTI=d")}, keys(cms.data()))
}

// A write that conflicts with another replica's is made again on the
// fresh object, and keeps the other's records; a hub that does not take
// the write, and a full record, fail with the codes the caller gets.
func TestPendingStoreFailures(t *testing.T) {
	tests := []struct {
		name     string
		cms      *fakeConfigMaps
		maxBytes int
		want     error
		message  string
	}{
		{name: "conflicts with other replicas", cms: &fakeConfigMaps{conflicts: pendingAttempts - 1}},
		{name: "conflicts without end", cms: &fakeConfigMaps{conflicts: pendingAttempts}, want: errdefs.ErrUnavailable, message: "conflicted"},
		{name: "hub unreachable", cms: &fakeConfigMaps{fail: errors.New("dial tcp: connection refused")}, want: errdefs.ErrUnavailable,
			message: "ConfigMap credbroker-system/credbroker-pending-revokes: the hub API server did not answer"},
		{name: "forbidden", cms: &fakeConfigMaps{fail: apierrors.NewForbidden(configMapsResource, DefaultPendingConfigMap, errors.New("no"))},
			want: errdefs.ErrUnavailable, message: "deploy/hub/rbac.yaml"},
		{name: "full", cms: &fakeConfigMaps{}, maxBytes: 200, want: errdefs.ErrResourceExhausted, message: "more than its limit of 200"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, _, _ := newTestStore(t, tt.cms, tt.maxBytes)
			err := s.Record(t.Context(), []PendingRevoke{
				{Grant: pendingGrant("JTI=a", "one", time.Hour)}, {Grant: pendingGrant("JTI=b", "one", time.Hour)},
			})
			if tt.want == nil {
				require.NoError(t, err)
				assert.Len(t, tt.cms.data(), 2)
				return
			}
			require.ErrorIs(t, err, tt.want)
			assert.ErrorContains(t, err, tt.message)
			assert.NotContains(t, err.Error(), "dial tcp", "the hub's address")
		})
	}
}

// Forget drops only what the ConfigMap holds, and costs no write
// otherwise; a failed write is made again.
func TestPendingStoreForget(t *testing.T) {
	cms := &fakeConfigMaps{}
	s, _, _ := newTestStore(t, cms, 0)
	require.NoError(t, s.Record(t.Context(), []PendingRevoke{
		{Grant: pendingGrant("JTI=a", "one", time.Hour)}, {Grant: pendingGrant("JTI=b", "one", time.Hour)},
	}))
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	writes := cms.writes
	s.Forget([]string{"JTI=unknown"})
	s.Forget([]string{"JTI=a"})
	require.Eventually(t, func() bool { return len(cms.data()) == 1 }, 10*time.Second, 10*time.Millisecond)
	assert.Contains(t, cms.data(), pendingKey("JTI=b"))
	assert.Equal(t, writes+1, cms.writes, "one write for the one known id")

	cms.mu.Lock()
	cms.conflicts = pendingAttempts // the next round fails
	cms.mu.Unlock()
	s.Forget([]string{"JTI=b"})
	require.Eventually(t, func() bool { return len(cms.data()) == 0 }, 10*time.Second, 10*time.Millisecond)
}

// fakeRecorder records what a Registry records and forgets.
type fakeRecorder struct {
	mu       sync.Mutex
	fail     error
	recorded []string
	forgot   []string
}

func (f *fakeRecorder) Record(_ context.Context, revokes []PendingRevoke) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return f.fail
	}
	for _, p := range revokes {
		f.recorded = append(f.recorded, p.Grant.GetCredentialId())
	}
	return nil
}

func (f *fakeRecorder) Forget(ids []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.forgot = append(f.forgot, ids...)
}

func (f *fakeRecorder) forgotten() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.forgot...)
}

// gatedRevoker revokes only while its cluster's agent is connected.
type gatedRevoker struct {
	mu        sync.Mutex
	connected bool
	asked     []string
}

func (g *gatedRevoker) Revoke(_ context.Context, _ fleet.ClusterRef, ids []string, _ string) ([]string, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.asked = append(g.asked, ids...)
	if !g.connected {
		return nil, errdefs.ErrUnavailable
	}
	return ids, nil
}

func (g *gatedRevoker) set(connected bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.connected = connected
}

func (g *gatedRevoker) count(id string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for _, a := range g.asked {
		if a == id {
			n++
		}
	}
	return n
}

// A revoke that no agent confirms is answered pending only once recorded;
// when it cannot be recorded, the caller is told, with the code of the
// failure.
func TestRegistryRevokeRecorded(t *testing.T) {
	tests := []struct {
		name      string
		fail      error
		connected bool
		wantErr   error
		recorded  []string
	}{
		{name: "agent confirms: nothing recorded", connected: true},
		{name: "agent unreachable: recorded", recorded: []string{"JTI=a"}},
		{name: "agent unreachable, hub down", fail: errdefs.ErrUnavailable, wantErr: errdefs.ErrUnavailable},
		{name: "agent unreachable, record full", fail: errdefs.ErrResourceExhausted, wantErr: errdefs.ErrResourceExhausted},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := &fakeRecorder{fail: tt.fail}
			rev := &gatedRevoker{connected: tt.connected}
			r, err := NewRegistry(RegistryConfig{Revoker: rev, Pending: rec, Clock: clocktesting.NewFakePassiveClock(pendingStart)})
			require.NoError(t, err)
			g := pendingGrant("JTI=a", "one", time.Hour)
			revoked, pending, err := r.RevokeRecorded(t.Context(), []*pb.Grant{g}, "test")
			assert.Equal(t, tt.recorded, rec.recorded)
			assert.True(t, r.Revoked("JTI=a"))
			if tt.wantErr != nil {
				require.ErrorIs(t, err, tt.wantErr)
				assert.ErrorContains(t, err, "0 of 1 grants were revoked; no agent confirmed the other 1")
				return
			}
			require.NoError(t, err)
			if tt.connected {
				assert.Len(t, revoked, 1)
				assert.Empty(t, pending)
				assert.Equal(t, []string{"JTI=a"}, rec.forgotten())
			} else {
				assert.Empty(t, revoked)
				assert.Len(t, pending, 1)
			}
		})
	}
}

// A replica that learns of another's pending revoke sends it when the
// agent connects, whether or not the agent's hello reports the grant, and
// forgets it once the agent confirms; a revoke it confirmed itself is
// forgotten at once.
func TestRegistryLearnsPendingRevokes(t *testing.T) {
	cluster := fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "one"}, UID: "uid-one"}
	tests := []struct {
		name string
		// hello is what the agent reports when it comes back.
		hello []*pb.Grant
	}{
		{name: "the hello reports the grant", hello: []*pb.Grant{pendingGrant("JTI=a", "one", time.Hour)}},
		{name: "the hello does not report it"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := &fakeRecorder{}
			rev := &gatedRevoker{}
			// The hello sends the revoke again after RetryInterval.
			r, err := NewRegistry(RegistryConfig{Revoker: rev, Pending: rec, Clock: clocktesting.NewFakePassiveClock(pendingStart),
				RetryInterval: time.Millisecond})
			require.NoError(t, err)
			r.Learn(t.Context(), []PendingRevoke{
				{Grant: pendingGrant("JTI=a", "one", time.Hour), Reason: "leaked"},
				{Grant: pendingGrant("JTI=old", "one", -time.Minute)},
			})
			assert.True(t, r.Revoked("JTI=a"), "a revoke another replica took counts as revoked here")
			assert.False(t, r.Revoked("JTI=old"))
			require.Eventually(t, func() bool { return rev.count("JTI=a") == 1 }, 10*time.Second, 10*time.Millisecond,
				"the learnt revoke is tried at once")
			assert.Empty(t, rec.forgotten())

			rev.set(true)
			require.NoError(t, r.Hello(t.Context(), cluster, tt.hello))
			require.Eventually(t, func() bool { return len(rec.forgotten()) == 1 }, 10*time.Second, 10*time.Millisecond)
			assert.Equal(t, []string{"JTI=a"}, rec.forgotten())
			assert.Equal(t, 2, rev.count("JTI=a"), "sent once more, at the hello")
			assert.True(t, r.Revoked("JTI=a"))

			// The same record seen again, before its removal is written.
			r.Learn(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=a", "one", time.Hour)}})
			assert.Equal(t, []string{"JTI=a", "JTI=a"}, rec.forgotten())
			assert.Equal(t, 2, rev.count("JTI=a"), "a confirmed revoke is not sent again")
		})
	}
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		if !strings.HasPrefix(k, "#") {
			out = append(out, k)
		}
	}
	return out
}

// A stream's report that a pending grant is gone confirms nothing: every
// stream of the cluster is sent the pending ids, so a rogue holder of the
// cluster's SVID could otherwise wipe the record for every replica. The
// revoke is sent again, and the record stays until the agents answer it.
func TestRemovalReportDoesNotConfirmAPendingRevoke(t *testing.T) {
	cluster := fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "one"}, UID: "uid-one"}
	rec := &fakeRecorder{}
	rev := &gatedRevoker{}
	// The removals send the revoke again after RetryInterval.
	r, err := NewRegistry(RegistryConfig{Revoker: rev, Pending: rec, Clock: clocktesting.NewFakePassiveClock(pendingStart),
		RetryInterval: time.Millisecond})
	require.NoError(t, err)
	r.Learn(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=a", "one", time.Hour), Reason: "leaked"}})
	require.Eventually(t, func() bool { return rev.count("JTI=a") == 1 }, 10*time.Second, 10*time.Millisecond)

	require.NoError(t, r.Report(t.Context(), cluster, &pb.GrantUpdate{Removed: []string{"JTI=a"}}))
	require.Eventually(t, func() bool { return rev.count("JTI=a") == 2 }, 10*time.Second, 10*time.Millisecond,
		"the removal sends the revoke again")
	assert.Empty(t, rec.forgotten(), "one stream's word removes no record")
	assert.True(t, r.Revoked("JTI=a"))
	r.Learn(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=a", "one", time.Hour), Reason: "leaked"}})
	assert.Empty(t, rec.forgotten(), "nor does this replica's view of it")

	rev.set(true)
	require.NoError(t, r.Report(t.Context(), cluster, &pb.GrantUpdate{Removed: []string{"JTI=a"}}))
	require.Eventually(t, func() bool { return len(rec.forgotten()) == 1 }, 10*time.Second, 10*time.Millisecond,
		"the agents' answer to the revoke removes it")
}

// A replica that took one stream's word that a grant is gone still sends
// the revoke that another replica recorded for it, and keeps the record.
func TestRecordOfAGrantReportedGoneIsStillSent(t *testing.T) {
	cluster := fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: "one"}, UID: "uid-one"}
	rec := &fakeRecorder{}
	rev := &gatedRevoker{}
	r, err := NewRegistry(RegistryConfig{Revoker: rev, Pending: rec, Clock: clocktesting.NewFakePassiveClock(pendingStart)})
	require.NoError(t, err)
	require.NoError(t, r.Hello(t.Context(), cluster, []*pb.Grant{pendingGrant("JTI=b", "one", time.Hour)}))
	require.NoError(t, r.Report(t.Context(), cluster, &pb.GrantUpdate{Removed: []string{"JTI=b"}}))
	require.True(t, r.Revoked("JTI=b"))

	r.Learn(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=b", "one", time.Hour), Reason: "leaked"}})
	require.Eventually(t, func() bool { return rev.count("JTI=b") == 1 }, 10*time.Second, 10*time.Millisecond,
		"the recorded revoke is sent")
	assert.Empty(t, rec.forgotten())
}

// A reason of multi-byte runes past the limit, with control characters,
// is recorded clipped on a rune boundary and read back as written, and
// the record survives the next write: what Record acknowledged as
// recorded is not dropped as unreadable.
func TestPendingStoreLongReasonSurvives(t *testing.T) {
	tests := []struct {
		name   string
		reason string
	}{
		{name: "three-byte runes split at the limit", reason: strings.Repeat("€", 100)},
		{name: "four-byte runes split at the limit", reason: "a" + strings.Repeat("🔑", 75)},
		{name: "control characters", reason: "leaked\x07\n\tkey\x7f " + strings.Repeat("é", 150)},
		{name: "not UTF-8", reason: "bad \xff\xfe bytes " + strings.Repeat("<&>\"", 80)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cms := &fakeConfigMaps{}
			s, inf, _ := newTestStore(t, cms, 0)
			var seen []PendingRevoke
			s.OnChange(func(p []PendingRevoke) { seen = p })
			require.NoError(t, s.Record(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=a", "one", time.Hour), Reason: tt.reason}}))
			require.NoError(t, s.Record(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=b", "one", time.Hour)}}))
			assert.ElementsMatch(t, []string{pendingKey("JTI=a"), pendingKey("JTI=b")}, keys(cms.data()), "the first record survives the next write")

			inf.handler.OnAdd(cms.cms[DefaultPendingConfigMap].DeepCopy(), false)
			require.Len(t, seen, 2)
			for _, p := range seen {
				if p.Grant.GetCredentialId() != "JTI=a" {
					continue
				}
				assert.LessOrEqual(t, len(p.Reason), maxReasonLength)
				assert.True(t, utf8.ValidString(p.Reason))
				assert.False(t, strings.ContainsFunc(p.Reason, selector.IsControl))
				assert.NotEmpty(t, p.Reason)
				assert.True(t, strings.HasPrefix(tt.reason, p.Reason[:3]) || strings.Contains(p.Reason, "bytes"), "the reason is kept")
			}
		})
	}
}

// A confirmed revoke is dropped from the record even when this replica's
// informer last delivered a view older than its own write, which lacks
// the record.
func TestPendingStoreForgetWhileInformerLags(t *testing.T) {
	cms := &fakeConfigMaps{}
	s, inf, _ := newTestStore(t, cms, 0)
	require.NoError(t, s.Record(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=a", "one", time.Hour)}}))
	// The informer's event of the ConfigMap before the write arrives late.
	inf.handler.OnAdd(&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: DefaultPendingConfigMap, Namespace: "credbroker-system", ResourceVersion: "0"}}, false)

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	s.Forget([]string{"JTI=a"})
	require.Eventually(t, func() bool { return len(cms.data()) == 0 }, 10*time.Second, 10*time.Millisecond,
		"the confirmed revoke stays in the record")
}

// One ClusterProfile's revokes take at most its share of the record (an
// eighth by default), so a rogue agent that never answers and the hub
// ServiceAccount that revokes the grants it reported cannot fill the
// record for every other cluster: the revoke past the share is refused
// with ResourceExhausted naming the cluster, and other clusters' revokes
// are still recorded, also in the same call.
func TestPendingStoreClusterShare(t *testing.T) {
	cms := &fakeConfigMaps{}
	s, _, _ := newTestStore(t, cms, 0)
	reason := strings.Repeat("r", maxReasonLength)
	var err error
	n := 0
	for ; n < 10000 && err == nil; n++ {
		err = s.Record(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=rogue-"+strconv.Itoa(n), "rogue", time.Hour), Reason: reason}})
	}
	t.Logf("the rogue's cluster was refused at its record %d, with %d bytes recorded", n, dataSize(cms.data()))
	require.ErrorIs(t, err, errdefs.ErrResourceExhausted)
	assert.ErrorContains(t, err, "ClusterProfile fleet/rogue")
	assert.LessOrEqual(t, dataSize(cms.data()), DefaultPendingMaxBytes/DefaultPendingClusterShare, "the rogue's cluster takes at most its share")

	require.NoError(t, s.Record(t.Context(), []PendingRevoke{{Grant: pendingGrant("JTI=other-1", "other", time.Hour), Reason: reason}}),
		"another cluster's revoke is recorded")
	err = s.Record(t.Context(), []PendingRevoke{
		{Grant: pendingGrant("JTI=rogue-more", "rogue", time.Hour), Reason: reason},
		{Grant: pendingGrant("JTI=other-2", "other", time.Hour), Reason: reason},
	})
	require.ErrorIs(t, err, errdefs.ErrResourceExhausted)
	assert.ErrorContains(t, err, "1 revokes of ClusterProfile fleet/rogue")
	assert.ErrorContains(t, err, "1 revokes of other ClusterProfiles were recorded")
	assert.Contains(t, cms.data(), pendingKey("JTI=other-2"), "the other cluster's revoke in the same call")
	assert.NotContains(t, cms.data(), pendingKey("JTI=rogue-more"))
}

// A ConfigMap written by hand past the record's limit hands the replicas
// no more revokes than a full record holds.
func TestPendingStoreHandsOnAtMostMaxBytes(t *testing.T) {
	cms := &fakeConfigMaps{}
	const maxBytes = 4 << 10
	s, inf, _ := newTestStore(t, cms, maxBytes)
	var seen []PendingRevoke
	s.OnChange(func(p []PendingRevoke) { seen = p })
	data := map[string]string{}
	for i := range 1000 {
		key, value, _, err := s.encode(PendingRevoke{Grant: pendingGrant("JTI=x-"+strconv.Itoa(i), "one", time.Hour)}, pendingStart)
		require.NoError(t, err)
		data[key] = value
	}
	require.Greater(t, dataSize(data), 10*maxBytes)
	inf.handler.OnAdd(&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: DefaultPendingConfigMap}, Data: data}, false)
	require.NotEmpty(t, seen)
	size := 0
	for _, p := range seen {
		size += len(pendingKey(p.Grant.GetCredentialId())) + len(data[pendingKey(p.Grant.GetCredentialId())])
	}
	assert.LessOrEqual(t, size, maxBytes)
}

// A revoke whose record would not be read back is refused with
// InvalidArgument, instead of being answered as recorded and dropped at the
// next read.
func TestPendingStoreRefusesWhatItCannotReadBack(t *testing.T) {
	tests := []struct {
		name  string
		grant func(g *pb.Grant)
	}{
		{name: "ClusterProfile UID too long", grant: func(g *pb.Grant) { g.ClusterUid = strings.Repeat("u", 200) }},
		{name: "not a credential id", grant: func(g *pb.Grant) { g.CredentialId = "token" }},
		{name: "not a ClusterProfile name", grant: func(g *pb.Grant) { g.Cluster.Name = "Not_DNS" }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cms := &fakeConfigMaps{}
			s, _, _ := newTestStore(t, cms, 0)
			g := pendingGrant("JTI=a", "one", time.Hour)
			tt.grant(g)
			err := s.Record(t.Context(), []PendingRevoke{{Grant: g}})
			require.ErrorIs(t, err, errdefs.ErrInvalidArgument)
			assert.ErrorContains(t, err, "cannot be recorded")
			assert.Empty(t, cms.data())
		})
	}
}

// A replica holds no more learnt pending revokes than the record holds
// now: records that left the ConfigMap (confirmed by another replica,
// expired, or written by hand and rewritten) are dropped from memory, so
// rewriting the ConfigMap again and again with fresh records does not
// grow the brokers. A revoke that this replica could not record is kept.
func TestLearnKeepsOnlyTheRecordedSet(t *testing.T) {
	rec := &fakeRecorder{}
	rev := &gatedRevoker{}
	r, err := NewRegistry(RegistryConfig{Revoker: rev, Pending: rec, Clock: clocktesting.NewFakePassiveClock(pendingStart)})
	require.NoError(t, err)
	rec.fail = errdefs.ErrResourceExhausted
	_, _, err = r.RevokeRecorded(t.Context(), []*pb.Grant{pendingGrant("JTI=own", "one", time.Hour)}, "not recorded")
	require.ErrorIs(t, err, errdefs.ErrResourceExhausted)

	const rounds, perRound = 20, 100
	for round := range rounds {
		set := make([]PendingRevoke, perRound)
		for i := range set {
			set[i] = PendingRevoke{Grant: pendingGrant("JTI=x-"+strconv.Itoa(round)+"-"+strconv.Itoa(i), "one", time.Hour)}
		}
		r.Learn(t.Context(), set)
	}
	r.mu.Lock()
	n := len(r.pending)
	r.mu.Unlock()
	t.Logf("pending revokes held after %d rewrites of %d records: %d", rounds, perRound, n)
	assert.Equal(t, perRound+1, n, "the last set, and this replica's own")
	assert.True(t, r.Revoked("JTI=own"))
	assert.True(t, r.Revoked("JTI=x-19-0"))
	assert.False(t, r.Revoked("JTI=x-0-0"), "a record that left the ConfigMap")
}
