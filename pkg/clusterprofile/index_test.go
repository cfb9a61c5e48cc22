package clusterprofile_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	"sigs.k8s.io/cluster-inventory-api/client/clientset/versioned/fake"
	"sigs.k8s.io/cluster-inventory-api/client/informers/externalversions"

	"github.com/credbroker/credbroker/pkg/clusterprofile"
	"github.com/credbroker/credbroker/pkg/errdefs"
)

// source is a hand-built ListerWatcher: the test decides what the informer
// lists and which watch events it sees, so it can also make the informer
// miss events and relist, which is how tombstones happen.
type source struct {
	mu      sync.Mutex
	objs    map[string]*v1alpha1.ClusterProfile
	rv      int
	events  chan watch.Event // of the current watch
	watches chan struct{}    // one value per Watch call
}

func newSource(cps ...*v1alpha1.ClusterProfile) *source {
	s := &source{objs: map[string]*v1alpha1.ClusterProfile{}, watches: make(chan struct{}, 10)}
	for _, cp := range cps {
		s.put(cp)
	}
	return s
}

func (s *source) List(metav1.ListOptions) (runtime.Object, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	list := &v1alpha1.ClusterProfileList{ListMeta: metav1.ListMeta{ResourceVersion: strconv.Itoa(s.rv)}}
	for _, k := range slices.Sorted(maps.Keys(s.objs)) {
		list.Items = append(list.Items, *s.objs[k].DeepCopy())
	}
	return list, nil
}

func (s *source) Watch(metav1.ListOptions) (watch.Interface, error) {
	s.mu.Lock()
	s.events = make(chan watch.Event, 100)
	w := watch.NewProxyWatcher(s.events)
	s.mu.Unlock()
	s.watches <- struct{}{}
	return w, nil
}

// IsWatchListSemanticsUnSupported makes the reflector list, then watch.
func (s *source) IsWatchListSemanticsUnSupported() bool { return true }

// put stores cp with a new resource version, and a UID if it has none.
func (s *source) put(cp *v1alpha1.ClusterProfile) *v1alpha1.ClusterProfile {
	cp = cp.DeepCopy()
	s.rv++
	cp.ResourceVersion = strconv.Itoa(s.rv)
	if cp.UID == "" {
		cp.UID = types.UID(fmt.Sprintf("uid-%s-%d", cp.Name, s.rv))
	}
	s.objs[cp.Namespace+"/"+cp.Name] = cp
	return cp
}

func (s *source) send(typ watch.EventType, obj runtime.Object) {
	s.events <- watch.Event{Type: typ, Object: obj}
}

// Add, Update and Delete change the source and tell the watch.
func (s *source) Add(cp *v1alpha1.ClusterProfile) *v1alpha1.ClusterProfile {
	s.mu.Lock()
	defer s.mu.Unlock()
	cp = s.put(cp)
	s.send(watch.Added, cp.DeepCopy())
	return cp
}

func (s *source) Update(cp *v1alpha1.ClusterProfile) *v1alpha1.ClusterProfile {
	s.mu.Lock()
	defer s.mu.Unlock()
	cp = s.put(cp)
	s.send(watch.Modified, cp.DeepCopy())
	return cp
}

func (s *source) Delete(ns, name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cp := s.objs[ns+"/"+name]
	delete(s.objs, ns+"/"+name)
	s.rv++
	cp.ResourceVersion = strconv.Itoa(s.rv)
	s.send(watch.Deleted, cp)
}

// get returns a copy of the stored ClusterProfile ns/name.
func (s *source) get(ns, name string) *v1alpha1.ClusterProfile {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.objs[ns+"/"+name].DeepCopy()
}

// Unseen changes the source without telling the watch, then expires the
// watch so that the informer relists.
func (s *source) Unseen(t *testing.T, change func(objs map[string]*v1alpha1.ClusterProfile, put func(*v1alpha1.ClusterProfile) *v1alpha1.ClusterProfile)) {
	s.mu.Lock()
	change(s.objs, s.put)
	s.rv++
	gone := apierrors.NewResourceExpired("too old resource version")
	s.send(watch.Error, &gone.ErrStatus)
	s.mu.Unlock()
	s.waitWatch(t)
}

func (s *source) waitWatch(t testing.TB) {
	t.Helper()
	select {
	case <-s.watches:
	case <-time.After(30 * time.Second):
		t.Fatal("the informer did not watch")
	}
}

// logs collects log lines.
type logs struct {
	mu    sync.Mutex
	lines []string
}

func (l *logs) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.lines = append(l.lines, args)
	}, funcr.Options{})
}

func (l *logs) get() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.lines)
}

// changes collects OnChange calls.
type changes struct {
	mu   sync.Mutex
	seen []string
}

func (c *changes) record(key types.NamespacedName, uid types.UID) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seen = append(c.seen, key.String()+" "+string(uid))
}

func (c *changes) take() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.seen
	c.seen = nil
	return out
}

type harness struct {
	src     *source
	idx     *clusterprofile.Index
	logs    *logs
	changes *changes
}

// start runs an informer over a source holding cps and returns it with an
// Index over it, synced.
func start(t testing.TB, cps ...*v1alpha1.ClusterProfile) *harness {
	t.Helper()
	h := &harness{src: newSource(cps...), logs: &logs{}, changes: &changes{}}
	informer := cache.NewSharedIndexInformer(h.src, &v1alpha1.ClusterProfile{}, 0,
		cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	idx, err := clusterprofile.New(clusterprofile.Config{Informer: informer, TrustDomain: td, Log: h.logs.logger()})
	require.NoError(t, err)
	h.idx = idx

	_, err = idx.Get("fleet", "east-1")
	require.ErrorIs(t, err, errdefs.ErrUnavailable, "before the informer syncs")
	assert.False(t, idx.HasSynced())

	idx.OnChange(h.changes.record)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		informer.RunWithContext(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	require.True(t, cache.WaitForCacheSync(ctx.Done(), idx.HasSynced))
	h.src.waitWatch(t)
	return h
}

func idOf(s string) spiffeid.ID { return spiffeid.RequireFromString(s) }

func withUID(cp *v1alpha1.ClusterProfile, uid types.UID) *v1alpha1.ClusterProfile {
	cp.UID = uid
	return cp
}

// createdAt sets cp's creation time to sec seconds after a fixed instant.
func createdAt(cp *v1alpha1.ClusterProfile, sec int64) *v1alpha1.ClusterProfile {
	cp.CreationTimestamp = metav1.NewTime(time.Unix(1.7e9+sec, 0))
	return cp
}

func deleting(cp *v1alpha1.ClusterProfile) *v1alpha1.ClusterProfile {
	now := metav1.Now()
	cp.DeletionTimestamp = &now
	cp.Finalizers = []string{"example.com/hold"}
	return cp
}

func TestIndexLookups(t *testing.T) {
	h := start(t,
		profile("fleet", "east-1"),
		profile("fleet", "west-1", "spiffe://fleet.example/agents/west"),
		profile("other", "west-1"),
		profile("fleet", "bad-1", "not a spiffe id"),
		profile("fleet", "foreign-1", "spiffe://evil.example/agents/foreign"),
		// shared-2 was created first, so it holds the ID.
		createdAt(profile("fleet", "shared-1", "spiffe://fleet.example/agents/shared"), 2),
		createdAt(profile("fleet", "shared-2", "spiffe://fleet.example/agents/shared"), 1),
		// Created in the same second: the lower UID holds the ID.
		withUID(createdAt(profile("fleet", "tie-1", "spiffe://fleet.example/agents/tie"), 1), "uid-b"),
		withUID(createdAt(profile("fleet", "tie-2", "spiffe://fleet.example/agents/tie"), 1), "uid-a"),
		deleting(profile("fleet", "gone-1")),
		// A terminating holder keeps its ID; a terminating newcomer never had it.
		createdAt(deleting(profile("fleet", "moving-1", "spiffe://fleet.example/agents/moving")), 1),
		createdAt(profile("fleet", "moving-2", "spiffe://fleet.example/agents/moving"), 2),
		createdAt(deleting(profile("fleet", "leaving-1", "spiffe://fleet.example/agents/leaving")), 2),
		createdAt(profile("fleet", "leaving-2", "spiffe://fleet.example/agents/leaving"), 1),
		// Annotations may not reach into another profile's reserved ID.
		createdAt(profile("fleet", "steal-1", "spiffe://fleet.example/clusterprofile/other/west-1"), 0),
		createdAt(profile("fleet", "steal-2", "spiffe://fleet.example/clusterprofile/other/north-1"), 0),
		profile("fleet", "self-1", "spiffe://fleet.example/clusterprofile/fleet/self-1"),
	)

	t.Run("Get", func(t *testing.T) {
		tests := []struct {
			ns, name string
			wantErr  string
		}{
			{ns: "fleet", name: "east-1"},
			{ns: "fleet", name: "west-1"},
			{ns: "other", name: "west-1"},
			{ns: "fleet", name: "bad-1"},
			{ns: "fleet", name: "north-1", wantErr: "clusterprofile fleet/north-1 not found"},
			{ns: "other", name: "east-1", wantErr: "clusterprofile other/east-1 not found"},
			{ns: "", name: "east-1", wantErr: "clusterprofile /east-1 not found"},
			{ns: "fleet", name: "gone-1", wantErr: "clusterprofile fleet/gone-1 not found"},
		}
		for _, tt := range tests {
			t.Run(tt.ns+"/"+tt.name, func(t *testing.T) {
				cp, err := h.idx.Get(tt.ns, tt.name)
				if tt.wantErr != "" {
					require.EqualError(t, err, tt.wantErr)
					assert.ErrorIs(t, err, errdefs.ErrNotFound)
					return
				}
				require.NoError(t, err)
				assert.Equal(t, tt.ns, cp.Namespace)
				assert.Equal(t, tt.name, cp.Name)
			})
		}
	})

	t.Run("ForAgent", func(t *testing.T) {
		tests := []struct {
			name    string
			id      spiffeid.ID
			want    string
			wantErr string
		}{
			{
				name: "default ID",
				id:   idOf("spiffe://fleet.example/clusterprofile/fleet/east-1"),
				want: "fleet/east-1",
			},
			{
				name: "annotated ID",
				id:   idOf("spiffe://fleet.example/agents/west"),
				want: "fleet/west-1",
			},
			{
				name:    "default ID of an annotated profile",
				id:      idOf("spiffe://fleet.example/clusterprofile/fleet/west-1"),
				wantErr: "no ClusterProfile accepts agent spiffe://fleet.example/clusterprofile/fleet/west-1: permission denied",
			},
			{
				name:    "default ID of a profile with a bad annotation",
				id:      idOf("spiffe://fleet.example/clusterprofile/fleet/bad-1"),
				wantErr: "no ClusterProfile accepts agent spiffe://fleet.example/clusterprofile/fleet/bad-1: permission denied",
			},
			{
				name:    "default ID of a profile annotated with a foreign ID",
				id:      idOf("spiffe://fleet.example/clusterprofile/fleet/foreign-1"),
				wantErr: "no ClusterProfile accepts agent spiffe://fleet.example/clusterprofile/fleet/foreign-1: permission denied",
			},
			{
				name:    "foreign ID",
				id:      idOf("spiffe://evil.example/agents/foreign"),
				wantErr: "agent spiffe://evil.example/agents/foreign is outside trust domain fleet.example: permission denied",
			},
			{
				name:    "foreign ID with a default path",
				id:      idOf("spiffe://evil.example/clusterprofile/fleet/east-1"),
				wantErr: "agent spiffe://evil.example/clusterprofile/fleet/east-1 is outside trust domain fleet.example: permission denied",
			},
			{
				name:    "unknown",
				id:      idOf("spiffe://fleet.example/clusterprofile/fleet/north-1"),
				wantErr: "no ClusterProfile accepts agent spiffe://fleet.example/clusterprofile/fleet/north-1: permission denied",
			},
			{
				name:    "trust domain",
				id:      td.ID(),
				wantErr: "no ClusterProfile accepts agent spiffe://fleet.example: permission denied",
			},
			{
				name:    "zero",
				wantErr: "agent has no SPIFFE ID: permission denied",
			},
			{
				name: "claimed by two: the first holds it",
				id:   idOf("spiffe://fleet.example/agents/shared"),
				want: "fleet/shared-2",
			},
			{
				name: "claimed by two in one second: the lower UID holds it",
				id:   idOf("spiffe://fleet.example/agents/tie"),
				want: "fleet/tie-2",
			},
			{
				name: "default ID claimed by another profile's annotation",
				id:   idOf("spiffe://fleet.example/clusterprofile/other/west-1"),
				want: "other/west-1",
			},
			{
				name:    "default ID of a missing profile claimed by an annotation",
				id:      idOf("spiffe://fleet.example/clusterprofile/other/north-1"),
				wantErr: "no ClusterProfile accepts agent spiffe://fleet.example/clusterprofile/other/north-1: permission denied",
			},
			{
				name: "own default ID as annotation",
				id:   idOf("spiffe://fleet.example/clusterprofile/fleet/self-1"),
				want: "fleet/self-1",
			},
			{
				name:    "being deleted",
				id:      idOf("spiffe://fleet.example/clusterprofile/fleet/gone-1"),
				wantErr: "agent spiffe://fleet.example/clusterprofile/fleet/gone-1 belongs to clusterprofile fleet/gone-1, which is being deleted: permission denied",
			},
			{
				name:    "held by a profile being deleted",
				id:      idOf("spiffe://fleet.example/agents/moving"),
				wantErr: "agent spiffe://fleet.example/agents/moving belongs to clusterprofile fleet/moving-1, which is being deleted: permission denied",
			},
			{
				name: "claimed later by a profile being deleted",
				id:   idOf("spiffe://fleet.example/agents/leaving"),
				want: "fleet/leaving-2",
			},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				cp, err := h.idx.ForAgent(tt.id)
				if tt.wantErr != "" {
					require.EqualError(t, err, tt.wantErr)
					assert.ErrorIs(t, err, errdefs.ErrPermissionDenied)
					assert.Nil(t, cp)
					return
				}
				require.NoError(t, err)
				assert.Equal(t, tt.want, cp.Namespace+"/"+cp.Name)
			})
		}
	})

	t.Run("copies", func(t *testing.T) {
		cp, err := h.idx.Get("fleet", "east-1")
		require.NoError(t, err)
		cp.Labels = map[string]string{"mutated": "yes"}
		again, err := h.idx.ForAgent(idOf("spiffe://fleet.example/clusterprofile/fleet/east-1"))
		require.NoError(t, err)
		assert.Empty(t, again.Labels)
	})

	t.Run("CheckAgent", func(t *testing.T) {
		tests := []struct {
			name    string
			wantErr string
		}{
			{name: "east-1"},
			{name: "shared-2"},
			{name: "self-1"},
			{name: "moving-1"},
			{
				name:    "shared-1",
				wantErr: "clusterprofile fleet/shared-1 claims agent spiffe://fleet.example/agents/shared, which clusterprofile fleet/shared-2 claimed first and holds; give one of them another credbroker.io/agent-spiffe-id: failed precondition",
			},
			{
				name:    "moving-2",
				wantErr: "clusterprofile fleet/moving-2 claims agent spiffe://fleet.example/agents/moving, which clusterprofile fleet/moving-1 claimed first and holds; give one of them another credbroker.io/agent-spiffe-id: failed precondition",
			},
			{
				name:    "steal-1",
				wantErr: `clusterprofile fleet/steal-1: annotation credbroker.io/agent-spiffe-id="spiffe://fleet.example/clusterprofile/other/west-1" lies under the reserved path /clusterprofile/, where each ClusterProfile owns only its own default ID; choose an ID outside it; no agent can serve this ClusterProfile: failed precondition`,
			},
			{
				name:    "bad-1",
				wantErr: `clusterprofile fleet/bad-1: annotation credbroker.io/agent-spiffe-id="not a spiffe id" is not a SPIFFE ID (scheme is missing or invalid); no agent can serve this ClusterProfile: failed precondition`,
			},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				cp, err := h.idx.Get("fleet", tt.name)
				if errors.Is(err, errdefs.ErrNotFound) {
					// Get hides terminating profiles; CheckAgent still judges them.
					cp = h.src.get("fleet", tt.name)
				} else {
					require.NoError(t, err)
				}
				err = h.idx.CheckAgent(cp)
				if tt.wantErr != "" {
					require.EqualError(t, err, tt.wantErr)
					assert.Equal(t, codes.FailedPrecondition, errdefs.Code(err))
					return
				}
				require.NoError(t, err)
			})
		}
	})

	// A ClusterProfile read from the API server before the informer has
	// seen it claims nothing yet: an agent ID that nobody claims is free,
	// and one that another profile holds is still refused.
	t.Run("CheckAgent of a profile the cache has not seen", func(t *testing.T) {
		require.NoError(t, h.idx.CheckAgent(withUID(profile("fleet", "unseen-1"), "uid-unseen")))
		err := h.idx.CheckAgent(withUID(profile("fleet", "unseen-2", "spiffe://fleet.example/agents/west"), "uid-unseen"))
		require.ErrorIs(t, err, errdefs.ErrFailedPrecondition)
		assert.ErrorContains(t, err, "which clusterprofile fleet/west-1 claimed first and holds")
	})

	t.Run("bad and contested annotations are logged", func(t *testing.T) {
		all := strings.Join(h.logs.get(), "\n")
		for _, want := range []string{
			`"clusterprofile"="fleet/bad-1"`,
			`"clusterprofile"="fleet/foreign-1"`,
			`"clusterprofile"="fleet/steal-1"`,
			`"clusterprofile"="fleet/shared-1" "holder"="fleet/shared-2"`,
			`"clusterprofile"="fleet/tie-1" "holder"="fleet/tie-2"`,
			`"clusterprofile"="fleet/moving-2" "holder"="fleet/moving-1"`,
		} {
			assert.Contains(t, all, want)
		}
		for _, never := range []string{"fleet/east-1", "fleet/self-1", `"clusterprofile"="fleet/shared-2"`} {
			assert.NotContains(t, all, never)
		}
	})

	t.Run("no changes on the initial list", func(t *testing.T) {
		// Adds only report ClusterProfiles sharing an agent ID with the new one.
		got := h.changes.take()
		for _, c := range got {
			assert.Regexp(t, `^(fleet/(shared|tie|moving|leaving)-[12]) `, c)
		}
	})
}

func TestIndexFollowsChanges(t *testing.T) {
	h := start(t, profile("fleet", "east-1"), profile("fleet", "west-1"))
	east, west := idOf("spiffe://fleet.example/clusterprofile/fleet/east-1"), idOf("spiffe://fleet.example/clusterprofile/fleet/west-1")
	agent := idOf("spiffe://fleet.example/agents/east")
	uidOf := func(name string) types.UID {
		cp, err := h.idx.Get("fleet", name)
		require.NoError(t, err)
		return cp.UID
	}
	eastUID, westUID := uidOf("east-1"), uidOf("west-1")
	require.Empty(t, h.changes.take())

	// wait returns the changes once the informer has delivered n of them.
	wait := func(t *testing.T, n int) []string {
		t.Helper()
		var got []string
		require.Eventually(t, func() bool {
			got = append(got, h.changes.take()...)
			return len(got) >= n
		}, 10*time.Second, 5*time.Millisecond)
		time.Sleep(50 * time.Millisecond)
		return append(got, h.changes.take()...)
	}

	t.Run("annotate", func(t *testing.T) {
		h.src.Update(withUID(profile("fleet", "east-1", agent.String()), eastUID))
		assert.Equal(t, []string{"fleet/east-1 " + string(eastUID)}, wait(t, 1))
		_, err := h.idx.ForAgent(east)
		assert.ErrorIs(t, err, errdefs.ErrPermissionDenied)
		cp, err := h.idx.ForAgent(agent)
		require.NoError(t, err)
		assert.Equal(t, "east-1", cp.Name)
	})

	t.Run("claim the same ID", func(t *testing.T) {
		h.src.Update(withUID(createdAt(profile("fleet", "west-1", agent.String()), 1), westUID))
		// east-1 is told too, and keeps its agent: it claimed the ID first.
		assert.ElementsMatch(t, []string{"fleet/west-1 " + string(westUID), "fleet/east-1 " + string(eastUID)}, wait(t, 2))
		cp, err := h.idx.ForAgent(agent)
		require.NoError(t, err)
		assert.Equal(t, "east-1", cp.Name)
		_, err = h.idx.ForAgent(west)
		assert.ErrorIs(t, err, errdefs.ErrPermissionDenied)
		lines := h.logs.get()
		require.Len(t, lines, 1)
		assert.Contains(t, lines[0], `"clusterprofile"="fleet/west-1" "holder"="fleet/east-1"`)
	})

	t.Run("bad annotation", func(t *testing.T) {
		h.src.Update(withUID(profile("fleet", "west-1", "spiffe://fleet.example/agents/west/"), westUID))
		assert.ElementsMatch(t, []string{"fleet/west-1 " + string(westUID), "fleet/east-1 " + string(eastUID)}, wait(t, 2))
		cp, err := h.idx.ForAgent(agent)
		require.NoError(t, err)
		assert.Equal(t, "east-1", cp.Name)
		_, err = h.idx.ForAgent(west)
		assert.ErrorIs(t, err, errdefs.ErrPermissionDenied)
		lines := h.logs.get()
		require.Len(t, lines, 2)
		assert.Contains(t, lines[1], `"clusterprofile"="fleet/west-1"`)
	})

	t.Run("delete", func(t *testing.T) {
		h.src.Delete("fleet", "west-1")
		assert.Equal(t, []string{"fleet/west-1 " + string(westUID)}, wait(t, 1))
		_, err := h.idx.Get("fleet", "west-1")
		assert.EqualError(t, err, "clusterprofile fleet/west-1 not found")
	})

	t.Run("deletion starts", func(t *testing.T) {
		h.src.Update(withUID(deleting(profile("fleet", "east-1", agent.String())), eastUID))
		assert.Equal(t, []string{"fleet/east-1 " + string(eastUID)}, wait(t, 1))
		_, err := h.idx.Get("fleet", "east-1")
		assert.ErrorIs(t, err, errdefs.ErrNotFound)
		_, err = h.idx.ForAgent(agent)
		assert.EqualError(t, err, "agent spiffe://fleet.example/agents/east belongs to clusterprofile fleet/east-1, which is being deleted: permission denied")
	})

	t.Run("deletion unseen: tombstone", func(t *testing.T) {
		h.src.Unseen(t, func(objs map[string]*v1alpha1.ClusterProfile, _ func(*v1alpha1.ClusterProfile) *v1alpha1.ClusterProfile) {
			delete(objs, "fleet/east-1")
		})
		assert.Equal(t, []string{"fleet/east-1 " + string(eastUID)}, wait(t, 1))
	})

	t.Run("recreation unseen: old and new UID", func(t *testing.T) {
		old := h.src.Add(profile("fleet", "north-1"))
		wait(t, 0)
		require.Equal(t, old.UID, uidOf("north-1"))
		var recreated *v1alpha1.ClusterProfile
		h.src.Unseen(t, func(_ map[string]*v1alpha1.ClusterProfile, put func(*v1alpha1.ClusterProfile) *v1alpha1.ClusterProfile) {
			recreated = put(profile("fleet", "north-1"))
		})
		require.NotEqual(t, old.UID, recreated.UID)
		assert.Equal(t, []string{"fleet/north-1 " + string(old.UID), "fleet/north-1 " + string(recreated.UID)}, wait(t, 2))
		assert.Equal(t, recreated.UID, uidOf("north-1"))
	})
}

func TestNew(t *testing.T) {
	newInformer := func() cache.SharedIndexInformer {
		return externalversions.NewSharedInformerFactory(fake.NewSimpleClientset(), 0).Apis().V1alpha1().ClusterProfiles().Informer()
	}
	shared := newInformer()
	_, err := clusterprofile.New(clusterprofile.Config{Informer: shared, TrustDomain: td})
	require.NoError(t, err)

	tests := []struct {
		name    string
		cfg     clusterprofile.Config
		wantErr string
	}{
		{name: "no informer", cfg: clusterprofile.Config{TrustDomain: td}, wantErr: "clusterprofile index: no informer: invalid argument"},
		{name: "no trust domain", cfg: clusterprofile.Config{Informer: newInformer()}, wantErr: "clusterprofile index: no trust domain: invalid argument"},
		{name: "twice on one informer", cfg: clusterprofile.Config{Informer: shared, TrustDomain: td}, wantErr: `clusterprofile index: add indexer "agentID": indexer conflict: map[agentID:{}]: invalid argument`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			idx, err := clusterprofile.New(tt.cfg)
			require.EqualError(t, err, tt.wantErr)
			assert.ErrorIs(t, err, errdefs.ErrInvalidArgument)
			assert.Nil(t, idx)
		})
	}
}
