package grants

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/go-logr/logr"
	"google.golang.org/protobuf/types/known/timestamppb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/grants/selector"
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
			"configMap", s.cfg.Namespace+"/"+s.cfg.Name, "ignored", over, "maxBytes", s.cfg.MaxBytes)
	}
	s.mu.Lock()
	fns := s.onChange
	s.mu.Unlock()
	for _, fn := range fns {
		fn(live)
	}
}

// Record implements PendingRecorder. The revokes of a ClusterProfile
// whose records would take more than MaxClusterBytes, or that would make
// the record larger than MaxBytes, are refused with
// errdefs.ErrResourceExhausted; the others are still recorded, and the
// error says how many.
func (s *PendingStore) Record(ctx context.Context, revokes []PendingRevoke) error {
	if len(revokes) == 0 {
		return nil
	}
	var refusal error
	err := s.modify(ctx, func(data, clusterOf map[string]string, now time.Time) (bool, error) {
		refusal = nil
		type entry struct{ key, value string }
		var order []string
		groups := map[string][]entry{}
		for _, p := range revokes {
			key, value, cluster, err := s.encode(p, now)
			if err != nil {
				return false, err
			}
			if key == "" {
				continue
			}
			if _, ok := groups[cluster]; !ok {
				order = append(order, cluster)
			}
			groups[cluster] = append(groups[cluster], entry{key, value})
		}
		sizes := map[string]int{}
		for key, value := range data {
			sizes[clusterOf[key]] += len(key) + len(value)
		}
		total := dataSize(data)
		changed := false
		var refusedCluster string
		refused, recorded, refusedClusters := 0, 0, 0
		for _, cluster := range order {
			add := 0
			for _, e := range groups[cluster] {
				add += len(e.key) + len(e.value)
				if old, ok := data[e.key]; ok {
					add -= len(e.key) + len(old)
				}
			}
			switch {
			case total+add > s.cfg.MaxBytes:
				return false, fmt.Errorf("the hub's record of pending revokes, ConfigMap %s/%s, would hold %d bytes, more than its limit of %d; "+
					"it empties as agents come back and tokens expire: %w", s.cfg.Namespace, s.cfg.Name, total+add, s.cfg.MaxBytes, errdefs.ErrResourceExhausted)
			case sizes[cluster]+add > s.cfg.MaxClusterBytes:
				if refusedClusters == 0 {
					refusedCluster = fmt.Sprintf("%s, whose records would take %d bytes", cluster, sizes[cluster]+add)
				}
				refusedClusters++
				refused += len(groups[cluster])
				continue
			}
			for _, e := range groups[cluster] {
				data[e.key] = e.value
				clusterOf[e.key] = cluster
			}
			sizes[cluster] += add
			total += add
			recorded += len(groups[cluster])
			changed = true
		}
		if refused > 0 {
			others := ""
			if refusedClusters > 1 {
				others = fmt.Sprintf(" and %d other ClusterProfiles", refusedClusters-1)
			}
			refusal = fmt.Errorf("the hub's record of pending revokes, ConfigMap %s/%s, has no room for %d revokes of ClusterProfile %s%s, "+
				"more than the share of %d bytes that one ClusterProfile may take; %d revokes of other ClusterProfiles were recorded; "+
				"the share empties as that ClusterProfile's agents answer and its tokens expire: %w",
				s.cfg.Namespace, s.cfg.Name, refused, refusedCluster, others, s.cfg.MaxClusterBytes, recorded, errdefs.ErrResourceExhausted)
		}
		return changed, nil
	})
	if err != nil {
		return err
	}
	return refusal
}

// Forget implements PendingRecorder. It queues every id, whatever this
// replica's informer last showed: the informer may lag behind this
// replica's own writes, and a removal of a key the ConfigMap does not hold
// costs a read but no write.
func (s *PendingStore) Forget(ids []string) {
	if len(ids) == 0 {
		return
	}
	s.mu.Lock()
	for _, id := range ids {
		s.forget[pendingKey(id)] = id
	}
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// pendingRetry is how long the forget loop waits after a failed write.
const pendingRetry = time.Second

// Run drops the forgotten revokes from the ConfigMap until ctx ends.
func (s *PendingStore) Run(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.wake:
		}
		s.mu.Lock()
		keys := s.forget
		s.forget = map[string]string{}
		s.mu.Unlock()
		if len(keys) == 0 {
			continue
		}
		err := s.modify(ctx, func(data, _ map[string]string, _ time.Time) (bool, error) {
			changed := false
			for key := range keys {
				if _, ok := data[key]; ok {
					delete(data, key)
					changed = true
				}
			}
			return changed, nil
		})
		if err == nil {
			continue
		}
		s.cfg.Log.Info("confirmed revokes not dropped from the hub's record; retrying",
			"configMap", s.cfg.Namespace+"/"+s.cfg.Name, "revokes", len(keys), "reason", err.Error())
		s.mu.Lock()
		for key, id := range keys {
			s.forget[key] = id
		}
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(pendingRetry):
		}
		select {
		case s.wake <- struct{}{}:
		default:
		}
	}
}

// pendingAttempts bounds the read-modify-write attempts of one change that
// other replicas' writes conflict with.
const pendingAttempts = 8

// modify reads the ConfigMap (or starts an empty one), drops its expired
// and unreadable records, lets change edit its data, and writes it back if
// change says so or anything was dropped, again on a conflict. clusterOf
// holds the ClusterProfile, namespace/name, of each key of data.
func (s *PendingStore) modify(ctx context.Context, change func(data, clusterOf map[string]string, now time.Time) (bool, error)) error {
	var last error
	for range pendingAttempts {
		cm, err := s.cfg.ConfigMaps.Get(ctx, s.cfg.Name, metav1.GetOptions{})
		create := apierrors.IsNotFound(err)
		if err != nil && !create {
			return s.hubFailure("read", err)
		}
		if create {
			cm = &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{
				Name: s.cfg.Name, Namespace: s.cfg.Namespace,
				Labels: map[string]string{"app.kubernetes.io/name": "credbroker", "app.kubernetes.io/component": "broker"},
			}}
		}
		now := s.cfg.Clock.Now()
		data := map[string]string{}
		clusterOf := map[string]string{}
		pruned := false
		for key, value := range cm.Data {
			p, err := s.decode(key, value, now)
			if err != nil || p.Grant == nil {
				pruned = true
				continue
			}
			data[key] = value
			clusterOf[key] = p.Grant.GetCluster().GetNamespace() + "/" + p.Grant.GetCluster().GetName()
		}
		changed, err := change(data, clusterOf, now)
		if err != nil {
			return err
		}
		if !changed && !pruned {
			return nil
		}
		cm = cm.DeepCopy()
		cm.Data = data
		if create {
			_, err = s.cfg.ConfigMaps.Create(ctx, cm, metav1.CreateOptions{})
		} else {
			_, err = s.cfg.ConfigMaps.Update(ctx, cm, metav1.UpdateOptions{})
		}
		switch {
		case err == nil:
			return nil
		case apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err):
			last = err
			continue
		default:
			return s.hubFailure("write", err)
		}
	}
	s.cfg.Log.Info("pending revokes not written: every attempt conflicted with another writer",
		"configMap", s.cfg.Namespace+"/"+s.cfg.Name, "attempts", pendingAttempts, "reason", last.Error())
	return fmt.Errorf("could not write the hub's record of pending revokes, ConfigMap %s/%s: %d attempts conflicted with other writers: %w",
		s.cfg.Namespace, s.cfg.Name, pendingAttempts, errdefs.ErrUnavailable)
}

// hubFailure describes a failed read or write of the ConfigMap.
func (s *PendingStore) hubFailure(op string, err error) error {
	reason := "the hub API server did not answer"
	var st apierrors.APIStatus
	switch {
	case errors.As(err, &st):
		reason = fmt.Sprintf("%s (%d)", st.Status().Reason, st.Status().Code)
		if apierrors.IsForbidden(err) {
			reason += "; the broker needs get, update and create on it (deploy/hub/rbac.yaml)"
		}
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		reason = "the hub API server did not answer in time"
	}
	return fmt.Errorf("could not %s the hub's record of pending revokes, ConfigMap %s/%s: %s: %w",
		op, s.cfg.Namespace, s.cfg.Name, reason, errdefs.ErrUnavailable)
}

// pendingRecord is the JSON value of one pending revoke in the ConfigMap:
// nothing secret, only what the revoke needs.
type pendingRecord struct {
	CredentialID string    `json:"credentialID"`
	Cluster      string    `json:"cluster"`
	ClusterUID   string    `json:"clusterUID,omitempty"`
	Expires      time.Time `json:"expires"`
	Reason       string    `json:"reason,omitempty"`
}

// maxPendingRecord bounds one record's value.
const maxPendingRecord = 2048

// pendingKey is the ConfigMap key of the revoke of id: a hash, since a
// credential id may hold characters that keys may not.
func pendingKey(id string) string {
	sum := sha256.Sum256([]byte(id))
	return "r." + hex.EncodeToString(sum[:16])
}

// encode returns the key, value and ClusterProfile (namespace/name) of p,
// whose expiry it bounds by MaxLifetime from now, and whose reason it
// cleans, and an empty key for a revoke without a credential id or of a
// token that has expired. It fails, with errdefs.ErrInvalidArgument, for a
// revoke whose record decode would not read back.
func (s *PendingStore) encode(p PendingRevoke, now time.Time) (string, string, string, error) {
	g := p.Grant
	id := g.GetCredentialId()
	exp := g.GetExpirationTime().AsTime()
	if id == "" || !exp.After(now) {
		return "", "", "", nil
	}
	rec := pendingRecord{
		CredentialID: id,
		Cluster:      g.GetCluster().GetNamespace() + "/" + g.GetCluster().GetName(),
		ClusterUID:   g.GetClusterUid(),
		Expires:      minTime(exp, now.Add(s.cfg.MaxLifetime)).UTC(),
		Reason:       cleanReason(p.Reason),
	}
	key := pendingKey(id)
	var buf strings.Builder
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	err := enc.Encode(rec)
	value := strings.TrimSuffix(buf.String(), "\n")
	if err == nil {
		err = checkRecord(key, value, rec)
	}
	if err != nil {
		return "", "", "", fmt.Errorf("the revoke of %s on ClusterProfile %s cannot be recorded: %w: %w", selector.Clip(id), selector.Clip(rec.Cluster), err, errdefs.ErrInvalidArgument)
	}
	return key, value, rec.Cluster, nil
}

// cleanReason drops what decode refuses from reason: bytes that are not
// UTF-8 and control characters, and clips it to maxReasonLength bytes on a
// rune boundary.
func cleanReason(reason string) string {
	reason = strings.ToValidUTF8(reason, "")
	reason = strings.Map(func(r rune) rune {
		if selector.IsControl(r) {
			return -1
		}
		return r
	}, reason)
	if len(reason) <= maxReasonLength {
		return reason
	}
	// reason is valid UTF-8, so reason[0] starts a rune and the loop ends.
	cut := maxReasonLength
	for !utf8.RuneStart(reason[cut]) {
		cut--
	}
	return reason[:cut]
}

// checkRecord is the check of a record that encode makes before it writes
// one and decode makes when it reads one: what encode writes, decode reads
// back.
func checkRecord(key, value string, rec pendingRecord) error {
	ns, name, _ := strings.Cut(rec.Cluster, "/")
	switch {
	case len(value) > maxPendingRecord:
		return errors.New("record too long")
	case key != pendingKey(rec.CredentialID):
		return errors.New("key does not match the credential id")
	case !selector.IsCredentialID(rec.CredentialID):
		return errors.New("not a credential id")
	case len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0:
		return errors.New("not a ClusterProfile")
	case len(rec.ClusterUID) > 128:
		return errors.New("ClusterProfile UID too long")
	case len(rec.Reason) > maxReasonLength || !utf8.ValidString(rec.Reason) || strings.ContainsFunc(rec.Reason, selector.IsControl):
		return errors.New("reason too long or not text")
	}
	return nil
}

// decode reads one record. It returns an error for a record that is not
// one this package writes, and a PendingRevoke without a Grant for one that
// has expired. A record's expiry is bounded by MaxLifetime from now.
func (s *PendingStore) decode(key, value string, now time.Time) (PendingRevoke, error) {
	if len(value) > maxPendingRecord {
		return PendingRevoke{}, errors.New("record too long")
	}
	var rec pendingRecord
	if err := json.Unmarshal([]byte(value), &rec); err != nil {
		return PendingRevoke{}, err
	}
	if err := checkRecord(key, value, rec); err != nil {
		return PendingRevoke{}, err
	}
	if !rec.Expires.After(now) {
		return PendingRevoke{}, nil
	}
	ns, name, _ := strings.Cut(rec.Cluster, "/")
	exp := minTime(rec.Expires, now.Add(s.cfg.MaxLifetime))
	return PendingRevoke{
		Grant: &pb.Grant{
			CredentialId:   rec.CredentialID,
			Cluster:        &pb.ObjectReference{Namespace: ns, Name: name},
			ClusterUid:     rec.ClusterUID,
			ExpirationTime: timestamppb.New(exp),
		},
		Reason: rec.Reason,
	}, nil
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func dataSize(data map[string]string) int {
	n := 0
	for k, v := range data {
		n += len(k) + len(v)
	}
	return n
}
