package grants

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"google.golang.org/protobuf/types/known/timestamppb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
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
	// present holds the keys of the ConfigMap as last seen or written.
	present map[string]bool
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
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	s := &PendingStore{cfg: cfg, present: map[string]bool{}, forget: map[string]string{}, wake: make(chan struct{}, 1)}
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
		live    []PendingRevoke
		invalid int
	)
	present := map[string]bool{}
	if cm != nil {
		for key, value := range cm.Data {
			present[key] = true
			p, err := s.decode(key, value, now)
			switch {
			case err != nil:
				invalid++
			case p.Grant != nil:
				live = append(live, p)
			}
		}
	}
	if invalid > 0 {
		s.cfg.Log.Info("pending revoke records could not be read; they are dropped at the next write",
			"configMap", s.cfg.Namespace+"/"+s.cfg.Name, "invalid", invalid)
	}
	s.mu.Lock()
	s.present = present
	fns := s.onChange
	s.mu.Unlock()
	for _, fn := range fns {
		fn(live)
	}
}

// Record implements PendingRecorder.
func (s *PendingStore) Record(ctx context.Context, revokes []PendingRevoke) error {
	if len(revokes) == 0 {
		return nil
	}
	return s.modify(ctx, func(data map[string]string, now time.Time) (bool, error) {
		for _, p := range revokes {
			key, value, ok := s.encode(p, now)
			if ok {
				data[key] = value
			}
		}
		if n := dataSize(data); n > s.cfg.MaxBytes {
			return false, fmt.Errorf("the hub's record of pending revokes, ConfigMap %s/%s, would hold %d bytes, more than its limit of %d; "+
				"it empties as agents come back and tokens expire: %w", s.cfg.Namespace, s.cfg.Name, n, s.cfg.MaxBytes, errdefs.ErrResourceExhausted)
		}
		return true, nil
	})
}

// Forget implements PendingRecorder. Only ids that the ConfigMap holds, as
// this replica last saw or wrote it, cost a write.
func (s *PendingStore) Forget(ids []string) {
	s.mu.Lock()
	n := 0
	for _, id := range ids {
		if key := pendingKey(id); s.present[key] {
			s.forget[key] = id
			n++
		}
	}
	s.mu.Unlock()
	if n == 0 {
		return
	}
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
		err := s.modify(ctx, func(data map[string]string, _ time.Time) (bool, error) {
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
// change says so or anything was dropped, again on a conflict.
func (s *PendingStore) modify(ctx context.Context, change func(data map[string]string, now time.Time) (bool, error)) error {
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
		pruned := false
		for key, value := range cm.Data {
			if p, err := s.decode(key, value, now); err != nil || p.Grant == nil {
				pruned = true
				continue
			}
			data[key] = value
		}
		changed, err := change(data, now)
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
			s.mu.Lock()
			s.present = make(map[string]bool, len(data))
			for key := range data {
				s.present[key] = true
			}
			s.mu.Unlock()
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

// encode returns the key and value of p, whose expiry it bounds by
// MaxLifetime from now, and false for a revoke without a credential id or
// of a token that has expired.
func (s *PendingStore) encode(p PendingRevoke, now time.Time) (string, string, bool) {
	g := p.Grant
	id := g.GetCredentialId()
	exp := g.GetExpirationTime().AsTime()
	if id == "" || !exp.After(now) {
		return "", "", false
	}
	exp = minTime(exp, now.Add(s.cfg.MaxLifetime))
	reason := p.Reason
	if len(reason) > maxReasonLength {
		reason = reason[:maxReasonLength]
	}
	raw, err := json.Marshal(pendingRecord{
		CredentialID: id,
		Cluster:      g.GetCluster().GetNamespace() + "/" + g.GetCluster().GetName(),
		ClusterUID:   g.GetClusterUid(),
		Expires:      exp.UTC(),
		Reason:       reason,
	})
	if err != nil {
		return "", "", false
	}
	return pendingKey(id), string(raw), true
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
	ns, name, _ := strings.Cut(rec.Cluster, "/")
	jti, ok := strings.CutPrefix(rec.CredentialID, "JTI=")
	switch {
	case key != pendingKey(rec.CredentialID):
		return PendingRevoke{}, errors.New("key does not match the credential id")
	case !ok || jti == "" || len(jti) > maxJTILength || strings.ContainsFunc(jti, notVisibleASCII):
		return PendingRevoke{}, errors.New("not a credential id")
	case len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0:
		return PendingRevoke{}, errors.New("not a ClusterProfile")
	case len(rec.ClusterUID) > 128 || len(rec.Reason) > maxReasonLength || strings.ContainsFunc(rec.Reason, isControl):
		return PendingRevoke{}, errors.New("field too long")
	}
	if !rec.Expires.After(now) {
		return PendingRevoke{}, nil
	}
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
