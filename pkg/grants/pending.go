package grants

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/fleet"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// PendingRevoke is a revoke that no agent has confirmed yet. Grant carries
// only what the revoke needs: the credential id, the ClusterProfile and its
// UID, and the token's expiry.
type PendingRevoke struct {
	Grant  *pb.Grant
	Reason string
}

// PendingRecorder keeps pending revokes where every broker replica finds
// them; *PendingStore is one. A Registry records the revokes that no agent
// confirmed before it answers, and forgets them once an agent confirms.
type PendingRecorder interface {
	// Record stores revokes. Once it returns nil, every replica sends them
	// again until an agent confirms or their tokens expire. Errors wrap
	// errdefs.ErrUnavailable (the hub did not take the write) or
	// errdefs.ErrResourceExhausted (the store is full).
	Record(ctx context.Context, revokes []PendingRevoke) error
	// Forget drops the revokes of ids, which an agent confirmed, in the
	// background; it does not block.
	Forget(ids []string)
}

// ConfigMapClient is what a PendingStore needs of the ConfigMaps of the
// broker's namespace; the broker passes the hub client's
// CoreV1().ConfigMaps(namespace).
type ConfigMapClient interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.ConfigMap, error)
	Create(ctx context.Context, cm *corev1.ConfigMap, opts metav1.CreateOptions) (*corev1.ConfigMap, error)
	Update(ctx context.Context, cm *corev1.ConfigMap, opts metav1.UpdateOptions) (*corev1.ConfigMap, error)
}

// Defaults of PendingStoreConfig.
const (
	// DefaultPendingConfigMap is the name of the ConfigMap that holds the
	// pending revokes, in the broker's namespace.
	DefaultPendingConfigMap = "credbroker-pending-revokes"
	// DefaultPendingMaxBytes bounds the ConfigMap's data, well under the
	// 1 MiB an object may have: about 2,000 pending revokes.
	DefaultPendingMaxBytes = 512 << 10
	// DefaultPendingClusterShare divides MaxBytes into the share of it that
	// the records of one ClusterProfile may take by default: an eighth, so
	// that one cluster's agents, which never answer, fill at most an eighth
	// of the record and leave the rest to the other clusters.
	DefaultPendingClusterShare = 8
)

// PendingStoreConfig configures a PendingStore.
type PendingStoreConfig struct {
	// ConfigMaps reads and writes the ConfigMap; required. Namespace names
	// it in messages.
	ConfigMaps ConfigMapClient
	Namespace  string
	// Informer watches the ConfigMap, and only it (a field selector on
	// metadata.name); required. The broker starts it.
	Informer Informer
	// Name of the ConfigMap. Default DefaultPendingConfigMap.
	Name string
	// MaxLifetime is the longest lifetime of a token, which bounds how long
	// a pending revoke is kept whatever expiry it names; required.
	MaxLifetime time.Duration
	// MaxBytes bounds the ConfigMap's data: a revoke that would make it
	// larger is refused. Default DefaultPendingMaxBytes.
	MaxBytes int
	// MaxClusterBytes bounds the bytes that the records of one
	// ClusterProfile may take: a revoke that would make its
	// ClusterProfile's records larger is refused, and the other
	// ClusterProfiles' revokes are still recorded. Default
	// MaxBytes/DefaultPendingClusterShare.
	MaxClusterBytes int
	// Clock expires the records. Default: the real clock.
	Clock clock.PassiveClock
	// Log receives records that could not be read and writes that failed.
	// Default: discard.
	Log logr.Logger
}

// PendingStore keeps the pending revokes of every broker replica in one
// ConfigMap of the hub, keyed by a hash of the credential id: each replica
// writes the revokes it could not deliver before it answers, and watches
// the ConfigMap to send the others' again when an agent comes back. Writes
// are read-modify-write with the ConfigMap's resourceVersion, and every write
// drops the records whose tokens have expired. It is safe for concurrent
// use.
type PendingStore struct {
	cfg PendingStoreConfig

	mu sync.Mutex
	// forget holds the credential ids to drop, by key.
	forget   map[string]string
	onChange []func([]PendingRevoke)
	wake     chan struct{}
}

var _ PendingRecorder = (*PendingStore)(nil)

// NewPendingStore validates cfg and returns a PendingStore, whose handler
// is registered on cfg.Informer.
func NewPendingStore(cfg PendingStoreConfig) (*PendingStore, error) {
	if cfg.ConfigMaps == nil || cfg.Informer == nil {
		return nil, errors.New("grants: the pending store's ConfigMaps and Informer are required")
	}
	if cfg.MaxLifetime <= 0 {
		return nil, errors.New("grants: the pending store's MaxLifetime must be positive")
	}
	if cfg.Name == "" {
		cfg.Name = DefaultPendingConfigMap
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultPendingMaxBytes
	}
	if cfg.MaxClusterBytes <= 0 {
		cfg.MaxClusterBytes = cfg.MaxBytes / DefaultPendingClusterShare
	}
	cfg.MaxClusterBytes = min(cfg.MaxClusterBytes, cfg.MaxBytes)
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	s := &PendingStore{cfg: cfg, forget: map[string]string{}, wake: make(chan struct{}, 1)}
	if _, err := cfg.Informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.observe(obj) },
		UpdateFunc: func(_, obj any) { s.observe(obj) },
		DeleteFunc: func(any) { s.observe(nil) },
	}); err != nil {
		return nil, fmt.Errorf("grants: pending store: %w", err)
	}
	return s, nil
}

// OnChange registers fn, which is called with the live pending revokes of
// the ConfigMap each time the informer sees it change. Register before the
// informer starts; fn must not block.
func (s *PendingStore) OnChange(fn func([]PendingRevoke)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.onChange = append(s.onChange, fn)
}

// HasSynced reports whether the informer has seen the ConfigMap, or that
// there is none.
func (s *PendingStore) HasSynced() bool { return s.cfg.Informer.HasSynced() }

func (s *PendingStore) observe(obj any) {
	cm, _ := obj.(*corev1.ConfigMap)
	if cm != nil && cm.Name != s.cfg.Name {
		return
	}
	now := s.cfg.Clock.Now()
	var (
		live          []PendingRevoke
		invalid, over int
		size          int
	)
	if cm != nil {
		// Only as much as this store would write is handed on, in the order
		// of the keys: a ConfigMap written by hand past MaxBytes costs the
		// replicas no more memory than a full one.
		keys := make([]string, 0, len(cm.Data))
		for key := range cm.Data {
			keys = append(keys, key)
		}
		slices.Sort(keys)
		for _, key := range keys {
			value := cm.Data[key]
			p, err := s.decode(key, value, now)
			switch {
			case err != nil:
				invalid++
			case p.Grant == nil:
			case size+len(key)+len(value) > s.cfg.MaxBytes:
				over++
			default:
				size += len(key) + len(value)
				live = append(live, p)
			}
		}
	}
	if invalid > 0 {
		s.cfg.Log.Info("pending revoke records could not be read; they are dropped at the next write",
			"configMap", s.cfg.Namespace+"/"+s.cfg.Name, "invalid", invalid)
	}
	if over > 0 {
		s.cfg.Log.Info("pending revoke records past the record's limit are ignored",
			"configMap", s.cfg.Namespace+"/"+s.cfg.Name, fleet.LogIgnored, over, "maxBytes", s.cfg.MaxBytes)
	}
	s.mu.Lock()
	fns := s.onChange
	s.mu.Unlock()
	for _, fn := range fns {
		fn(live)
	}
}
