package clusterprofile

import (
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// agentIDIndex is the name of the indexer New adds to the informer. It maps
// the string form of a SPIFFE ID to the ClusterProfiles that AgentID maps to
// it, live or being deleted.
const agentIDIndex = "agentID"

// Config configures an Index.
type Config struct {
	// Informer watches ClusterProfiles on the hub, such as
	// factory.Apis().V1alpha1().ClusterProfiles().Informer() from
	// sigs.k8s.io/cluster-inventory-api/client/informers/externalversions.
	// New adds an indexer named "agentID" and an event handler to it, so New
	// must be called before the informer (or its factory) is started, and at
	// most once per informer.
	Informer cache.SharedIndexInformer
	// TrustDomain is the trust domain of every agent.
	TrustDomain spiffeid.TrustDomain
	// Log receives one error line per added or updated ClusterProfile whose
	// annotation is not a valid agent ID. The zero value discards.
	Log logr.Logger
}

// Index finds ClusterProfiles by name and by agent SPIFFE ID in an
// informer's cache. Its methods are safe for concurrent use.
type Index struct {
	informer cache.SharedIndexInformer
	indexer  cache.Indexer
	td       spiffeid.TrustDomain
	log      logr.Logger
	reg      cache.ResourceEventHandlerRegistration

	mu        sync.RWMutex
	callbacks []func(key types.NamespacedName, uid types.UID)
}

// New returns an Index over cfg.Informer. It adds an indexer named "agentID"
// and an event handler to the informer, so it must be called before the
// informer starts. It fails with errdefs.ErrInvalidArgument when the Config
// is incomplete or the informer already has an indexer of that name.
func New(cfg Config) (*Index, error) {
	if cfg.Informer == nil {
		return nil, fmt.Errorf("clusterprofile index: no informer: %w", errdefs.ErrInvalidArgument)
	}
	if cfg.TrustDomain.IsZero() {
		return nil, fmt.Errorf("clusterprofile index: no trust domain: %w", errdefs.ErrInvalidArgument)
	}
	i := &Index{
		informer: cfg.Informer,
		indexer:  cfg.Informer.GetIndexer(),
		td:       cfg.TrustDomain,
		log:      cfg.Log,
	}
	if err := cfg.Informer.AddIndexers(cache.Indexers{agentIDIndex: i.indexAgentID}); err != nil {
		return nil, fmt.Errorf("clusterprofile index: add indexer %q: %v: %w", agentIDIndex, err, errdefs.ErrInvalidArgument)
	}
	reg, err := cfg.Informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    i.onAdd,
		UpdateFunc: i.onUpdate,
		DeleteFunc: i.onDelete,
	})
	if err != nil {
		return nil, fmt.Errorf("clusterprofile index: add event handler: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	i.reg = reg
	return i, nil
}

// HasSynced reports whether the informer has listed every ClusterProfile and
// the Index has seen them all. Get and ForAgent fail with
// errdefs.ErrUnavailable until the informer's cache has synced.
func (i *Index) HasSynced() bool {
	return i.reg.HasSynced()
}

// Get returns a copy of the ClusterProfile namespace/name. It fails with
// errdefs.ErrNotFound when there is none or it is being deleted.
func (i *Index) Get(namespace, name string) (*v1alpha1.ClusterProfile, error) {
	if err := i.synced(); err != nil {
		return nil, err
	}
	obj, exists, err := i.indexer.GetByKey(namespace + "/" + name)
	if err != nil {
		return nil, fmt.Errorf("clusterprofile %s/%s: %w", namespace, name, err)
	}
	cp, ok := obj.(*v1alpha1.ClusterProfile)
	if !exists || !ok || cp.DeletionTimestamp != nil {
		return nil, fmt.Errorf("clusterprofile %s/%s %w", namespace, name, errdefs.ErrNotFound)
	}
	return cp.DeepCopy(), nil
}

// ForAgent returns a copy of the one live ClusterProfile that the agent id
// serves, as AgentID defines it. It fails with errdefs.ErrPermissionDenied
// when id is outside the trust domain, when no live ClusterProfile maps to
// id, and when several do: an ambiguous mapping is refused, and the error
// names the ClusterProfiles that claim id.
func (i *Index) ForAgent(id spiffeid.ID) (*v1alpha1.ClusterProfile, error) {
	if id.IsZero() {
		return nil, fmt.Errorf("agent has no SPIFFE ID: %w", errdefs.ErrPermissionDenied)
	}
	if !id.MemberOf(i.td) {
		return nil, fmt.Errorf("agent %s is outside trust domain %s: %w", id, i.td, errdefs.ErrPermissionDenied)
	}
	if err := i.synced(); err != nil {
		return nil, err
	}
	objs, err := i.indexer.ByIndex(agentIDIndex, id.String())
	if err != nil {
		return nil, fmt.Errorf("clusterprofiles of agent %s: %w", id, err)
	}
	var live []*v1alpha1.ClusterProfile
	for _, obj := range objs {
		if cp, ok := obj.(*v1alpha1.ClusterProfile); ok && cp.DeletionTimestamp == nil {
			live = append(live, cp)
		}
	}
	switch len(live) {
	case 0:
		return nil, fmt.Errorf("no ClusterProfile accepts agent %s: %w", id, errdefs.ErrPermissionDenied)
	case 1:
		return live[0].DeepCopy(), nil
	}
	names := make([]string, len(live))
	for k, cp := range live {
		names[k] = cp.Namespace + "/" + cp.Name
	}
	slices.Sort(names)
	return nil, fmt.Errorf("agent %s maps to %d ClusterProfiles (%s); an ambiguous mapping is refused: %w",
		id, len(names), strings.Join(names, ", "), errdefs.ErrPermissionDenied)
}

// OnChange registers fn to be called with the key and UID of a
// ClusterProfile that was updated or deleted, so that the caller can re-check
// or close what it holds for that cluster. Callbacks run one at a time on the
// informer's handler goroutine, so fn must not block; OnChange may be called
// at any time.
//
// fn is called:
//   - on every update that changes the object (not on resyncs);
//   - on deletion, including the deletions the informer only learns of by
//     relisting (cache.DeletedFinalStateUnknown);
//   - with the old UID as well as the new one when a ClusterProfile was
//     deleted and recreated under the same name unseen by the informer;
//   - for every other ClusterProfile that shares an agent ID with one that
//     was added, updated or deleted, since their mapping may have become
//     ambiguous, or no longer be.
//
// uid is empty only when the informer lost a deleted object altogether; treat
// it as any UID of key.
func (i *Index) OnChange(fn func(key types.NamespacedName, uid types.UID)) {
	i.mu.Lock()
	defer i.mu.Unlock()
	i.callbacks = append(i.callbacks, fn)
}

var errNotSynced = fmt.Errorf("clusterprofile cache has not synced yet: %w", errdefs.ErrUnavailable)

func (i *Index) synced() error {
	// Before the first list is in, a ClusterProfile may be missing and an
	// ambiguous agent ID may look unique: answer nothing.
	if !i.informer.HasSynced() {
		return errNotSynced
	}
	return nil
}

// indexAgentID is the IndexFunc of agentIDIndex. It must not fail: client-go
// panics on an IndexFunc error, so a ClusterProfile without a valid agent ID
// is indexed under no ID. onAdd and onUpdate log those.
func (i *Index) indexAgentID(obj any) ([]string, error) {
	cp, ok := obj.(*v1alpha1.ClusterProfile)
	if !ok {
		return nil, nil
	}
	id, err := AgentID(i.td, cp)
	if err != nil {
		return nil, nil
	}
	return []string{id.String()}, nil
}

func (i *Index) onAdd(obj any) {
	cp, ok := obj.(*v1alpha1.ClusterProfile)
	if !ok {
		return
	}
	i.checkAgentID(cp)
	i.notify(nil, i.peers(keyOf(cp), cp))
}

func (i *Index) onUpdate(oldObj, newObj any) {
	older, ok1 := oldObj.(*v1alpha1.ClusterProfile)
	newer, ok2 := newObj.(*v1alpha1.ClusterProfile)
	if !ok1 || !ok2 {
		return
	}
	if older.ResourceVersion == newer.ResourceVersion && older.UID == newer.UID {
		return // a resync: nothing changed
	}
	i.checkAgentID(newer)
	key := keyOf(newer)
	var changed []change
	if older.UID != newer.UID {
		changed = append(changed, change{key, older.UID})
	}
	changed = append(changed, change{key, newer.UID})
	i.notify(changed, i.peers(key, older, newer))
}

func (i *Index) onDelete(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
		if _, ok := obj.(*v1alpha1.ClusterProfile); !ok {
			ns, name, err := cache.SplitMetaNamespaceKey(tomb.Key)
			if err != nil {
				i.log.Error(err, "clusterprofile tombstone has an unusable key", "key", tomb.Key)
				return
			}
			i.notify([]change{{types.NamespacedName{Namespace: ns, Name: name}, ""}}, nil)
			return
		}
	}
	cp, ok := obj.(*v1alpha1.ClusterProfile)
	if !ok {
		return
	}
	key := keyOf(cp)
	i.notify([]change{{key, cp.UID}}, i.peers(key, cp))
}

// checkAgentID logs a ClusterProfile that no agent can serve because of its
// annotation.
func (i *Index) checkAgentID(cp *v1alpha1.ClusterProfile) {
	if _, err := AgentID(i.td, cp); err != nil {
		i.log.Error(err, "clusterprofile has an invalid agent ID; no agent can serve it",
			"clusterprofile", keyOf(cp).String(), "annotation", AgentSPIFFEIDAnnotation)
	}
}

type change struct {
	key types.NamespacedName
	uid types.UID
}

// peers returns the ClusterProfiles other than key that share an agent ID
// with any of cps.
func (i *Index) peers(key types.NamespacedName, cps ...*v1alpha1.ClusterProfile) []change {
	var out []change
	for _, cp := range cps {
		id, err := AgentID(i.td, cp)
		if err != nil {
			continue
		}
		objs, err := i.indexer.ByIndex(agentIDIndex, id.String())
		if err != nil {
			i.log.Error(err, "clusterprofile index lookup failed", "agent", id.String())
			continue
		}
		for _, obj := range objs {
			p, ok := obj.(*v1alpha1.ClusterProfile)
			if !ok {
				continue
			}
			c := change{keyOf(p), p.UID}
			if c.key != key && !slices.Contains(out, c) {
				out = append(out, c)
			}
		}
	}
	return out
}

func (i *Index) notify(changed, peers []change) {
	if len(changed)+len(peers) == 0 {
		return
	}
	i.mu.RLock()
	fns := slices.Clone(i.callbacks)
	i.mu.RUnlock()
	for _, c := range slices.Concat(changed, peers) {
		for _, fn := range fns {
			fn(c.key, c.uid)
		}
	}
}

func keyOf(cp *v1alpha1.ClusterProfile) types.NamespacedName {
	return types.NamespacedName{Namespace: cp.Namespace, Name: cp.Name}
}
