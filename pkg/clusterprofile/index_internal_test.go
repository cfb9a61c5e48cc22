package clusterprofile

import (
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
)

// A tombstone whose last known state is lost still names the key, and the
// callback hears of it with an empty UID. The informer never builds one in
// practice, so it is tested here, below the public API.
func TestOnDeleteTombstoneWithoutObject(t *testing.T) {
	i := &Index{td: spiffeid.RequireTrustDomainFromString("fleet.example")}
	var got []string
	i.OnChange(func(key types.NamespacedName, uid types.UID) {
		got = append(got, key.String()+" "+string(uid))
	})
	i.onDelete(cache.DeletedFinalStateUnknown{Key: "fleet/east-1"})
	i.onDelete(cache.DeletedFinalStateUnknown{Key: "a/b/c"}) // unusable key: logged, not reported
	i.onDelete("not a ClusterProfile")
	assert.Equal(t, []string{"fleet/east-1 "}, got)
}

// A resync hands the handler the same object twice; OnChange promises no
// call for it. A ClusterProfile replaced unseen, same name and another UID,
// is a change for both UIDs. The informer resyncs only with a resync
// period, which the broker does not set, so it is tested here.
func TestOnUpdateSkipsResyncs(t *testing.T) {
	i := &Index{td: spiffeid.RequireTrustDomainFromString("fleet.example")}
	i.indexer = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{agentIDIndex: i.indexAgentID})
	var got []string
	i.OnChange(func(key types.NamespacedName, uid types.UID) {
		got = append(got, key.String()+" "+string(uid))
	})
	cp := func(uid, rv string) *v1alpha1.ClusterProfile {
		return &v1alpha1.ClusterProfile{ObjectMeta: metav1.ObjectMeta{
			Namespace: "fleet", Name: "east-1", UID: types.UID(uid), ResourceVersion: rv,
		}}
	}

	tests := []struct {
		name     string
		old, now *v1alpha1.ClusterProfile
		want     []string
	}{
		{name: "resync", old: cp("uid-1", "10"), now: cp("uid-1", "10")},
		{name: "update", old: cp("uid-1", "10"), now: cp("uid-1", "11"), want: []string{"fleet/east-1 uid-1"}},
		{name: "replaced", old: cp("uid-1", "10"), now: cp("uid-2", "12"), want: []string{"fleet/east-1 uid-1", "fleet/east-1 uid-2"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got = nil
			i.onUpdate(tt.old, tt.now)
			assert.Equal(t, tt.want, got)
		})
	}
}

// The facts that Lookup derived from a ClusterProfile object go when the
// informer replaces or deletes the object, so that they do not keep it
// alive; and facts derived from an object the informer no longer holds (a
// lookup that raced its update or delete) are not kept at all. The
// informer updates its store before it calls the handlers; so does the
// test.
func TestFactsGoWithTheirObject(t *testing.T) {
	i := &Index{td: spiffeid.RequireTrustDomainFromString("fleet.example"), facts: map[types.NamespacedName]*profileFacts{}}
	i.indexer = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{agentIDIndex: i.indexAgentID})
	key := types.NamespacedName{Namespace: "fleet", Name: "east-1"}
	cp := func(rv string) *v1alpha1.ClusterProfile {
		return &v1alpha1.ClusterProfile{ObjectMeta: metav1.ObjectMeta{Namespace: "fleet", Name: "east-1", UID: "uid-1", ResourceVersion: rv}}
	}
	older, newer := cp("10"), cp("11")

	require.NoError(t, i.indexer.Add(older))
	i.factsOf(key, older, "credbroker")
	assert.Len(t, i.facts, 1)
	require.NoError(t, i.indexer.Update(newer))
	i.onUpdate(older, newer)
	assert.Empty(t, i.facts, "after an update")
	i.factsOf(key, older, "credbroker")
	assert.Empty(t, i.facts, "kept for an object the informer replaced")

	i.factsOf(key, newer, "credbroker")
	assert.Len(t, i.facts, 1)
	require.NoError(t, i.indexer.Delete(newer))
	i.onDelete(newer)
	assert.Empty(t, i.facts, "after a delete")
	i.factsOf(key, newer, "credbroker")
	assert.Empty(t, i.facts, "kept for an object the informer deleted")

	require.NoError(t, i.indexer.Add(newer))
	i.factsOf(key, newer, "credbroker")
	require.NoError(t, i.indexer.Delete(newer))
	i.onDelete(cache.DeletedFinalStateUnknown{Key: "fleet/east-1"})
	assert.Empty(t, i.facts, "after a tombstone without its object")
}

// Facts are derived once per object and provider: a second lookup of the
// same object gets the same facts, and another provider, or a newer object
// that the informer holds before its handler ran, gets its own.
func TestFactsAreKeptPerObjectAndProvider(t *testing.T) {
	i := &Index{td: spiffeid.RequireTrustDomainFromString("fleet.example"), facts: map[types.NamespacedName]*profileFacts{}}
	i.indexer = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{agentIDIndex: i.indexAgentID})
	key := types.NamespacedName{Namespace: "fleet", Name: "east-1"}
	cp := func(rv, server string) *v1alpha1.ClusterProfile {
		c := &v1alpha1.ClusterProfile{ObjectMeta: metav1.ObjectMeta{Namespace: "fleet", Name: "east-1", UID: "uid-1", ResourceVersion: rv}}
		c.Status.AccessProviders = []v1alpha1.AccessProvider{
			{Name: "credbroker", Cluster: clientcmdv1.Cluster{Server: server}},
			{Name: "other", Cluster: clientcmdv1.Cluster{Server: server + "/other"}},
		}
		return c
	}
	older, newer := cp("10", "https://old.example"), cp("11", "https://new.example")
	require.NoError(t, i.indexer.Add(older))

	first := i.factsOf(key, older, "credbroker")
	assert.Same(t, first, i.factsOf(key, older, "credbroker"), "derived again for the same object")
	other := i.factsOf(key, older, "other")
	assert.Equal(t, "https://old.example/other", other.cluster.Server)

	// The informer's store holds the newer object; its handler has not
	// run yet, so the older object's facts are still kept.
	i.factsOf(key, older, "credbroker")
	require.NoError(t, i.indexer.Update(newer))
	assert.Equal(t, "https://new.example", i.factsOf(key, newer, "credbroker").cluster.Server)
}
