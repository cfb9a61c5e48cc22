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
	"github.com/credbroker/credbroker/pkg/fleet"
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
	// annotation is not a valid agent ID, and one per ClusterProfile that
	// claims an agent ID that another one holds. The zero value discards.
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

	// facts holds, per ClusterProfile, what Lookup derived from its
	// current object (lookup.go).
	factsMu sync.RWMutex
	facts   map[types.NamespacedName]*profileFacts
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
		facts:    map[types.NamespacedName]*profileFacts{},
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
	cp, err := i.Shared(namespace, name)
	if err != nil {
		return nil, err
	}
	return cp.DeepCopy(), nil
}

// Shared is Get without the copy: it returns the informer's own object,
// which the caller must neither modify nor keep. The exchange reads a
// ClusterProfile on every call, cached ones included, and a copy of it was
// a tenth of the bytes that a cached exchange allocated.
func (i *Index) Shared(namespace, name string) (*v1alpha1.ClusterProfile, error) {
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
	return cp, nil
}

// ForAgent returns a copy of the ClusterProfile that the agent id serves:
// the holder of id among the ClusterProfiles that claim it (see Holder). It
// fails with errdefs.ErrPermissionDenied when id is outside the trust domain,
// when no ClusterProfile claims id, and when its holder is being deleted: a
// terminating ClusterProfile keeps its agent ID until it is gone, so no
// other ClusterProfile inherits the agent meanwhile.
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
	holder, err := i.holder(id)
	if err != nil {
		return nil, err
	}
	if holder == nil {
		return nil, fmt.Errorf("no ClusterProfile accepts agent %s: %w", id, errdefs.ErrPermissionDenied)
	}
	if holder.DeletionTimestamp != nil {
		return nil, fmt.Errorf("agent %s belongs to clusterprofile %s, which is being deleted: %w",
			id, keyOf(holder), errdefs.ErrPermissionDenied)
	}
	return holder.DeepCopy(), nil
}

// CheckAgent reports whether an agent can serve cp. It fails with
// errdefs.ErrFailedPrecondition when cp's agent ID annotation is invalid, or
// when another ClusterProfile claimed the same agent ID first and so holds
// it; the error names the holder.
func (i *Index) CheckAgent(cp *v1alpha1.ClusterProfile) error {
	id, err := agentIDFault(agentID(i.td, cp))
	return i.checkHolder(cp, id, err)
}

// agentIDFault is agentID's answer with its error made the ClusterProfile's
// fault, as CheckAgent reports it.
func agentIDFault(id spiffeid.ID, err error) (spiffeid.ID, error) {
	if err != nil {
		// The annotation is the ClusterProfile's fault, not the request's.
		return id, fmt.Errorf("%w; no agent can serve this ClusterProfile: %w", err, errdefs.ErrFailedPrecondition)
	}
	return id, nil
}

// checkHolder is CheckAgent for cp whose agent ID is id, or idErr.
func (i *Index) checkHolder(cp *v1alpha1.ClusterProfile, id spiffeid.ID, idErr error) error {
	if idErr != nil {
		return idErr
	}
	if err := i.synced(); err != nil {
		return err
	}
	holder, err := i.holder(id)
	if err != nil {
		return err
	}
	if holder != nil && holder.UID != cp.UID {
		return fmt.Errorf("clusterprofile %s claims agent %s, which clusterprofile %s claimed first and holds; "+
			"give one of them another %s: %w", keyOf(cp), id, keyOf(holder), AgentSPIFFEIDAnnotation, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// holder returns the ClusterProfile that holds the agent ID id, live or
// being deleted: the first of its claimants, or nil when there is none.
func (i *Index) holder(id spiffeid.ID) (*v1alpha1.ClusterProfile, error) {
	claimants, err := i.claimants(id)
	if err != nil || len(claimants) == 0 {
		return nil, err
	}
	return claimants[0], nil
}

// claimants returns the ClusterProfiles whose agent ID is id, live or being
// deleted, the holder first: the one created first, then the lowest UID.
func (i *Index) claimants(id spiffeid.ID) ([]*v1alpha1.ClusterProfile, error) {
	objs, err := i.indexer.ByIndex(agentIDIndex, id.String())
	if err != nil {
		return nil, fmt.Errorf("clusterprofiles of agent %s: %w", id, err)
	}
	var out []*v1alpha1.ClusterProfile
	for _, obj := range objs {
		if cp, ok := obj.(*v1alpha1.ClusterProfile); ok {
			out = append(out, cp)
		}
	}
	slices.SortFunc(out, claimedFirst)
	return out, nil
}

// claimedFirst orders ClusterProfiles by creation, then by UID, which the
// API server never reuses: the order in which they claimed an agent ID.
func claimedFirst(a, b *v1alpha1.ClusterProfile) int {
	if c := a.CreationTimestamp.Compare(b.CreationTimestamp.Time); c != 0 {
		return c
	}
	return strings.Compare(string(a.UID), string(b.UID))
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
	i.forgetFacts(key) // they would keep the old object alive
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
			key := types.NamespacedName{Namespace: ns, Name: name}
			i.forgetFacts(key)
			i.notify([]change{{key, ""}}, nil)
			return
		}
	}
	cp, ok := obj.(*v1alpha1.ClusterProfile)
	if !ok {
		return
	}
	key := keyOf(cp)
	i.forgetFacts(key)
	i.notify([]change{{key, cp.UID}}, i.peers(key, cp))
}

// checkAgentID logs a ClusterProfile that no agent can serve because of its
// annotation, and every ClusterProfile that claims an agent ID that another
// one holds, naming both.
func (i *Index) checkAgentID(cp *v1alpha1.ClusterProfile) {
	id, err := AgentID(i.td, cp)
	if err != nil {
		i.log.Error(err, "clusterprofile has an invalid agent ID; no agent can serve it",
			"clusterprofile", keyOf(cp).String(), "annotation", AgentSPIFFEIDAnnotation)
		return
	}
	claimants, err := i.claimants(id)
	if err != nil || len(claimants) < 2 {
		return
	}
	holder, losers := claimants[0], claimants[1:]
	if holder.UID != cp.UID {
		losers = []*v1alpha1.ClusterProfile{cp}
	}
	for _, c := range losers {
		i.log.Error(nil, "clusterprofile claims an agent ID that another clusterprofile claimed first; no agent serves it",
			"clusterprofile", keyOf(c).String(), fleet.LogHolder, keyOf(holder).String(), fleet.LogAgent, id.String())
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
			i.log.Error(err, "clusterprofile index lookup failed", fleet.LogAgent, id.String())
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
