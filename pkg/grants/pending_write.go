package grants

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
)

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
			"configMap", s.cfg.Namespace+"/"+s.cfg.Name, "revokes", len(keys), fleet.LogErr, err.Error())
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
		"configMap", s.cfg.Namespace+"/"+s.cfg.Name, "attempts", pendingAttempts, fleet.LogErr, last.Error())
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
