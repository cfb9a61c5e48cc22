package spoke

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	testingclock "k8s.io/utils/clock/testing"

	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// syncLog is a logger whose lines may be read while others write them.
type syncLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *syncLog) logger() logr.Logger {
	return funcr.New(func(_, args string) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.b.WriteString(args + "\n")
	}, funcr.Options{})
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// change applies fn to the Secret key as someone other than the agent
// would, through the API server: the cache and the event handler see it.
func (f *fakeGrants) change(key string, fn func(*corev1.Secret)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.secrets[key]
	old := s.DeepCopy()
	fn(s)
	f.inform(old, s)
}

// tamperMinter runs a Minter over grants, with its grant events wired as
// the agent wires them, and mints one grant, apps/credbroker-grant-1 of
// credential id JTI=jti-apps-deployer, for fleet/a.
func tamperMinter(t *testing.T, grants *fakeGrants, log logr.Logger) (*Minter, *recorder, *testingclock.FakeClock) {
	t.Helper()
	clk := testingclock.NewFakeClock(issuedAt)
	m, err := New(withGrants(Config{
		Tokens: &fakeTokens{}, Clock: clk, CollectInterval: time.Hour, Log: log,
		ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd)),
	}, grants))
	require.NoError(t, err)
	grants.events = m.GrantEvents()
	r := &recorder{}
	t.Cleanup(m.Subscribe(r.fn))
	startRun(t, m, grants, clk)
	_, err = m.Mint(t.Context(), admitted("fleet/a"), &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ExpirationSeconds: 900})
	require.NoError(t, err)
	require.Equal(t, []string{"+JTI=jti-apps-deployer"}, r.summary())
	return m, r, clk
}

const tamperedKey = "apps/credbroker-grant-1"

// The attack: someone other than the agent (the opted-in ServiceAccount
// itself, with its own brokered token, if it may patch Secrets) changes a
// grant. Removing its label used to look like its deletion: the agent told
// the brokers it was gone, stopped its timer, and the token lived to its
// exp, out of reach of every revoke. Other changes reattribute it, move it
// out of its ClusterProfile's reach, or hold it alive. The agent must
// delete any grant that differs from what it wrote, which revokes the
// token; and the brokers must learn nothing of what the other party wrote,
// and of its removal only once it is gone.
func TestGrantChangedByAnotherIsDeleted(t *testing.T) {
	yes := true
	tests := []struct {
		name   string
		change func(*corev1.Secret)
		why    string
	}{
		{name: "grant label removed", change: func(s *corev1.Secret) { delete(s.Labels, GrantLabel) }, why: "label credbroker.io/grant removed"},
		{name: "grant label changed", change: func(s *corev1.Secret) { s.Labels[GrantLabel] = "false" }, why: "label credbroker.io/grant changed"},
		{name: "jti label removed", change: func(s *corev1.Secret) { delete(s.Labels, GrantJTILabel) }, why: "label credbroker.io/jti removed"},
		{name: "jti label changed", change: func(s *corev1.Secret) { s.Labels[GrantJTILabel] = "other" }, why: "label credbroker.io/jti changed"},
		{name: "ServiceAccount label changed", change: func(s *corev1.Secret) { s.Labels[GrantServiceAccountLabel] = "admin" }, why: "label credbroker.io/service-account changed"},
		{name: "label added", change: func(s *corev1.Secret) { s.Labels["credbroker.io/x"] = "y" }, why: "label credbroker.io/x added"},
		{name: "every label removed", change: func(s *corev1.Secret) { s.Labels = nil }, why: "label credbroker.io/grant removed"},
		{name: "hub user rewritten", change: func(s *corev1.Secret) { s.Annotations[GrantHubUserAnnotation] = flux }, why: "annotation credbroker.io/hub-user changed"},
		{name: "hub UID rewritten", change: func(s *corev1.Secret) { s.Annotations[GrantHubUIDAnnotation] = "other" }, why: "annotation credbroker.io/hub-uid changed"},
		{name: "hub groups rewritten", change: func(s *corev1.Secret) { s.Annotations[GrantHubGroupsAnnotation] = "system:masters" }, why: "annotation credbroker.io/hub-groups changed"},
		{name: "ClusterProfile rewritten", change: func(s *corev1.Secret) { s.Annotations[GrantClusterProfileAnnotation] = "fleet/b" }, why: "annotation credbroker.io/cluster-profile changed"},
		{name: "ClusterProfile UID rewritten", change: func(s *corev1.Secret) { s.Annotations[GrantClusterProfileUIDAnnotation] = "other" }, why: "annotation credbroker.io/cluster-profile-uid changed"},
		{name: "audiences rewritten", change: func(s *corev1.Secret) { s.Annotations[GrantAudiencesAnnotation] = "vault" }, why: "annotation credbroker.io/audiences changed"},
		{name: "ServiceAccount rewritten", change: func(s *corev1.Secret) { s.Annotations[GrantServiceAccountAnnotation] = "admin" }, why: "annotation credbroker.io/service-account changed"},
		{name: "credential id rewritten", change: func(s *corev1.Secret) { s.Annotations[GrantCredentialIDAnnotation] = "JTI=other" }, why: "annotation credbroker.io/credential-id changed"},
		{name: "credential id removed", change: func(s *corev1.Secret) { delete(s.Annotations, GrantCredentialIDAnnotation) }, why: "annotation credbroker.io/credential-id removed"},
		{name: "expiry pushed out", change: func(s *corev1.Secret) { s.Annotations[GrantExpirationAnnotation] = "2999-01-01T00:00:00Z" }, why: "annotation credbroker.io/expiration changed"},
		{name: "hub user removed", change: func(s *corev1.Secret) { delete(s.Annotations, GrantHubUserAnnotation) }, why: "annotation credbroker.io/hub-user removed"},
		{name: "annotation added", change: func(s *corev1.Secret) { s.Annotations["credbroker.io/note"] = "x" }, why: "annotation credbroker.io/note added"},
		{name: "finalizer added", change: func(s *corev1.Secret) { s.Finalizers = []string{"example.com/hold"} }, why: "finalizers added"},
		{name: "data added", change: func(s *corev1.Secret) { s.Data = map[string][]byte{"k": []byte("v")} }, why: "data added"},
		{
			name: "owner added",
			change: func(s *corev1.Secret) {
				s.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "ConfigMap", Name: "x", UID: "u"}}
			},
			why: "owner references added",
		},
		{name: "made immutable", change: func(s *corev1.Secret) { s.Immutable = &yes }, why: "made immutable"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			grants := newFakeGrants()
			var log syncLog
			m, r, _ := tamperMinter(t, grants, log.logger())
			grants.change(tamperedKey, tt.change)

			require.Eventually(t, func() bool { return len(grants.Keys()) == 0 }, 5*time.Second, time.Millisecond,
				"the agent left a grant that someone else changed")
			assert.Equal(t, []string{tamperedKey}, grants.Deleted())
			require.Eventually(t, func() bool { return len(r.summary()) == 2 }, 5*time.Second, time.Millisecond)
			assert.Equal(t, []string{"+JTI=jti-apps-deployer", "-JTI=jti-apps-deployer"}, r.summary(),
				"the brokers must hear only of the grant the agent wrote, and of its deletion")
			assert.Empty(t, m.Snapshot())
			require.Eventually(t, func() bool { return strings.Contains(log.String(), "deleted a grant that someone other") }, 5*time.Second, time.Millisecond)
			line := log.String()
			assert.Contains(t, line, `"msg"="found a grant that someone other than the agent changed; deleting it"`)
			assert.Contains(t, line, `"msg"="deleted a grant that someone other than the agent changed"`)
			assert.Contains(t, line, `"grant"="`+tamperedKey+`"`)
			assert.Contains(t, line, `"credentialID"="JTI=jti-apps-deployer"`)
			assert.Contains(t, line, `"change"="`+tt.why+`"`)
			assert.NotContains(t, line, fakeToken("apps", "deployer"))
		})
	}
}

// What the agent writes itself, and a grant being deleted, are not
// changes by another.
func TestGrantWrittenByTheAgentStays(t *testing.T) {
	grants := newFakeGrants()
	var log syncLog
	m, r, _ := tamperMinter(t, grants, log.logger())
	// A resync.
	grants.change(tamperedKey, func(*corev1.Secret) {})
	// A delete in the foreground: the API server sets the deletion
	// timestamp and a finalizer, which the garbage collector then removes.
	now := metav1.NewTime(issuedAt)
	grants.change(tamperedKey, func(s *corev1.Secret) {
		s.DeletionTimestamp = &now
		s.Finalizers = []string{metav1.FinalizerDeleteDependents}
	})
	grants.change(tamperedKey, func(s *corev1.Secret) { s.Finalizers = nil })

	// A grant changed after those is deleted after them: once it is gone,
	// the agent has judged every change before.
	_, err := m.Mint(t.Context(), admitted("fleet/a"), &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ExpirationSeconds: 900})
	require.NoError(t, err)
	grants.change("apps/credbroker-grant-2", func(s *corev1.Secret) { delete(s.Labels, GrantLabel) })
	require.Eventually(t, func() bool { return len(grants.Deleted()) > 0 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"apps/credbroker-grant-2"}, grants.Deleted())
	assert.Equal(t, []string{tamperedKey}, grants.Keys())
	assert.Equal(t, "+JTI=jti-apps-deployer", r.summary()[0])
	assert.Equal(t, 1, strings.Count(log.String(), "found a grant that someone other than the agent changed"), "only grant-2 was changed")
}

// A delete of a changed grant that fails is retried, and the brokers hear
// of the grant's removal only once it is gone.
func TestChangedGrantLeavesTheBrokersOnlyWhenDeleted(t *testing.T) {
	grants := newFakeGrants()
	var log syncLog
	_, r, clk := tamperMinter(t, grants, log.logger())
	grants.setDeleteErr(apierrors.NewInternalError(errors.New("boom")))
	grants.change(tamperedKey, func(s *corev1.Secret) { delete(s.Labels, GrantLabel) })
	require.Eventually(t, func() bool { return grants.Deletes() >= 1 }, 5*time.Second, time.Millisecond, "the agent never tried to delete the grant")
	require.Eventually(t, func() bool {
		return strings.Contains(log.String(), "failed to delete a grant that someone other than the agent changed")
	}, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{tamperedKey}, grants.Keys())
	assert.Equal(t, []string{"+JTI=jti-apps-deployer"}, r.summary(), "the brokers heard of a removal while the grant lives")

	grants.setDeleteErr(nil)
	clk.Step(time.Hour) // the sweep, if the retry has not come first
	require.Eventually(t, func() bool { return len(grants.Keys()) == 0 }, 5*time.Second, time.Millisecond)
	require.Eventually(t, func() bool { return len(r.summary()) == 2 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"+JTI=jti-apps-deployer", "-JTI=jti-apps-deployer"}, r.summary())
}

// A revoke of a changed grant deletes it by what the agent wrote: the
// ClusterProfile and credential id rewritten on it do not put it out of
// its broker's reach, and give no other broker a hold on it.
func TestRevokeOfAChangedGrant(t *testing.T) {
	grants := newFakeGrants()
	// No Run: nothing deletes the changed grant but the revoke.
	m, err := New(withGrants(Config{Tokens: &fakeTokens{},
		ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))}, grants))
	require.NoError(t, err)
	grants.events = m.GrantEvents()
	_, err = m.Mint(t.Context(), admitted("fleet/a"), &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ExpirationSeconds: 900})
	require.NoError(t, err)
	grants.change(tamperedKey, func(s *corev1.Secret) {
		s.Annotations[GrantClusterProfileAnnotation] = "fleet/b"
		s.Annotations[GrantCredentialIDAnnotation] = "JTI=other"
	})
	const id = "JTI=jti-apps-deployer"

	for _, req := range []struct {
		profile, id string
	}{{"fleet/b", id}, {"fleet/b", "JTI=other"}} {
		resp, err := m.Revoke(t.Context(), admitted(req.profile), &credbrokerv1alpha1.RevokeRequest{CredentialIds: []string{req.id}})
		require.NoError(t, err)
		assert.NotContains(t, resp.GetCredentialIds(), id)
		assert.Empty(t, grants.Deleted(), "the broker of %s revoked %s", req.profile, req.id)
	}
	resp, err := m.Revoke(t.Context(), admitted("fleet/a"), &credbrokerv1alpha1.RevokeRequest{CredentialIds: []string{id}})
	require.NoError(t, err)
	assert.Equal(t, []string{id}, resp.GetCredentialIds())
	assert.Equal(t, []string{tamperedKey}, grants.Deleted())
}

// The attack: a namespace owner deletes a grant in the foreground and holds
// it there with a dependent that has a finalizer, then rewrites the grant's
// credential id and hub user to another live grant's. The agent used to
// ignore every change to a grant being deleted, and told the brokers of
// the rewritten grant as added, under the other grant's credential id. It
// must judge the grant's own labels and annotations even while it is being
// deleted, and never tell the brokers of a deleting grant as added, nor in
// a hello.
func TestDeletingGrantRewrittenIsNotReported(t *testing.T) {
	grants := newFakeGrants()
	var log syncLog
	m, r, _ := tamperMinter(t, grants, log.logger())
	now := metav1.NewTime(issuedAt)
	grants.change(tamperedKey, func(s *corev1.Secret) {
		s.DeletionTimestamp = &now
		s.Finalizers = []string{metav1.FinalizerDeleteDependents}
	})
	grants.change(tamperedKey, func(s *corev1.Secret) {
		s.Annotations[GrantCredentialIDAnnotation] = "JTI=other"
		s.Annotations[GrantHubUserAnnotation] = flux
		s.Labels[GrantJTILabel] = "other"
	})
	assert.Empty(t, m.Snapshot(), "a hello told of a grant being deleted")
	require.Eventually(t, func() bool { return len(grants.Keys()) == 0 }, 5*time.Second, time.Millisecond,
		"the agent left a grant that someone else changed")
	require.Eventually(t, func() bool { return len(r.summary()) == 2 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, []string{"+JTI=jti-apps-deployer", "-JTI=jti-apps-deployer"}, r.summary(),
		"the brokers must hear only of the grant the agent wrote, and of its deletion")
	assert.Contains(t, log.String(), `"msg"="found a grant that someone other than the agent changed; deleting it"`)
	assert.Contains(t, log.String(), `"credentialID"="JTI=jti-apps-deployer"`)
}

// A grant being deleted that an agent sees first (at start-up, say) is not
// told to the brokers, as added nor in a hello: its token dies within a
// minute of its deletion anyway, and the agent cannot tell what it wrote.
func TestDeletingGrantSeenFirstIsNotReported(t *testing.T) {
	now := metav1.NewTime(issuedAt)
	src := newFakeGrants()
	tamperMinter(t, src, logr.Discard())
	g := src.Get(tamperedKey)
	g.DeletionTimestamp = &now
	g.Finalizers = []string{metav1.FinalizerDeleteDependents}

	grants := newFakeGrants()
	m, err := New(withGrants(Config{Tokens: &fakeTokens{},
		ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))}, grants))
	require.NoError(t, err)
	grants.events = m.GrantEvents()
	r := &recorder{}
	t.Cleanup(m.Subscribe(r.fn))
	grants.mu.Lock()
	grants.secrets[tamperedKey] = g.DeepCopy()
	grants.inform(nil, g)
	grants.mu.Unlock()
	assert.Empty(t, r.summary(), "the brokers heard of a grant being deleted as added")
	assert.Empty(t, m.Snapshot(), "a hello told of a grant being deleted")
}

// Labels and annotations that are not the agent's (outside credbroker.io/)
// steer no trust decision: a mutating webhook or policy that stamps every
// Secret must not make the agent delete every grant. Only the agent's own
// keys, finalizers, data, owners and immutability are judged.
func TestForeignLabelsAndAnnotationsAreKept(t *testing.T) {
	tests := []struct {
		name   string
		change func(*corev1.Secret)
	}{
		{name: "label added", change: func(s *corev1.Secret) { s.Labels["team"] = "x" }},
		{name: "prefixed label added", change: func(s *corev1.Secret) { s.Labels["example.com/cost-center"] = "42" }},
		{name: "annotation added", change: func(s *corev1.Secret) { s.Annotations["example.com/note"] = "x" }},
		{name: "look-alike prefix", change: func(s *corev1.Secret) { s.Annotations["credbroker.io.example.com/x"] = "y" }},
		{name: "labels and annotations", change: func(s *corev1.Secret) {
			s.Labels["policies.kyverno.io/managed"] = "true"
			s.Annotations["policies.kyverno.io/last-applied-patches"] = "add-labels"
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			grants := newFakeGrants()
			var log syncLog
			m, r, _ := tamperMinter(t, grants, log.logger())
			grants.change(tamperedKey, tt.change)
			// A grant changed after it is deleted after it: once it is
			// gone, the agent has judged the change before.
			_, err := m.Mint(t.Context(), admitted("fleet/a"), &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ExpirationSeconds: 900})
			require.NoError(t, err)
			grants.change("apps/credbroker-grant-2", func(s *corev1.Secret) { delete(s.Labels, GrantLabel) })
			require.Eventually(t, func() bool { return len(grants.Deleted()) > 0 }, 5*time.Second, time.Millisecond)
			assert.Equal(t, []string{"apps/credbroker-grant-2"}, grants.Deleted())
			assert.Equal(t, []string{tamperedKey}, grants.Keys(), "the agent deleted a grant another party only labelled")
			assert.Equal(t, "+JTI=jti-apps-deployer", r.summary()[0])
			assert.Equal(t, 1, strings.Count(log.String(), "found a grant that someone other than the agent changed"))
			snap := m.Snapshot()
			require.Len(t, snap, 1)
			assert.Equal(t, "JTI=jti-apps-deployer", snap[0].GetCredentialId())
		})
	}
}
