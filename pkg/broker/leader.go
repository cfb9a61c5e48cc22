package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
)

// The timing of the broker's Leases, client-go's usual: a replica that
// dies without releasing its Lease is replaced within leaseDuration plus
// a retryPeriod.
const (
	leaseDuration = 15 * time.Second
	renewDeadline = 10 * time.Second
	retryPeriod   = 2 * time.Second
)

// lease is a Lease that one replica at a time holds, and what the holder
// does.
type lease struct {
	namespace, name string
	// what names the work in logs; grant names the RBAC that gives the
	// Lease to the broker, for the error when the hub refuses it.
	what, grant string
	// lead does the work until ctx ends; leading, when set, tells whether
	// it runs.
	lead    func(ctx context.Context)
	leading *atomic.Bool
	// reach, when set, records whether the hub answers this replica's
	// reads and writes of the Lease.
	reach *leaseReach
}

// leaseReach records since when, and why, the hub has failed every read
// or write of a Lease that a replica made: a namespace that does not
// exist, say. A follower reads the Lease that another replica holds, so
// reaching it is what every replica of a healthy broker does, leading or
// not; a replica that cannot is one that no replica may be leading for.
type leaseReach struct {
	mu      sync.Mutex
	since   time.Time // zero while the last read or write succeeded
	lastErr error
}

func (r *leaseReach) record(now time.Time, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case err == nil:
		r.since, r.lastErr = time.Time{}, nil
	case r.since.IsZero():
		r.since, r.lastErr = now, err
	default:
		r.lastErr = err
	}
}

// failing returns the last error when every read and write has failed for
// at least d.
func (r *leaseReach) failing(now time.Time, d time.Duration) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.since.IsZero() || now.Sub(r.since) < d {
		return nil
	}
	return r.lastErr
}

// identity is this replica's name in its Leases: PublishIdentity, or a
// random name drawn once.
func (b *Broker) identity() string {
	b.identityOnce.Do(func() {
		b.leaseIdentity = b.cfg.PublishIdentity
		if b.leaseIdentity == "" {
			var r [8]byte
			_, _ = rand.Read(r[:])
			b.leaseIdentity = "credbroker-broker-" + hex.EncodeToString(r[:])
		}
	})
	return b.leaseIdentity
}

// campaign runs l.lead while this replica holds the Lease, and campaigns
// again when it loses it, until ctx ends; it returns nil then. The lead of
// a lost term returns before the next term's starts. When the hub
// refuses the broker the Lease (403), campaign returns an error: a replica
// that can never lead must not look like a follower.
func (b *Broker) campaign(ctx context.Context, l lease) error {
	id := b.identity()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	lock := &forbiddenLock{Interface: &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: l.namespace, Name: l.name},
		Client:     b.hubClient.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: id},
	}, cancel: cancel}
	if l.reach != nil {
		lock.reached = func(err error) { l.reach.record(b.cfg.Clock.Now(), err) }
	}
	// One term's lead at a time: client-go starts a term's in a goroutine
	// of its own and does not wait for it to return.
	var term sync.Mutex
	elector, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            lock,
		LeaseDuration:   leaseDuration,
		RenewDeadline:   renewDeadline,
		RetryPeriod:     retryPeriod,
		ReleaseOnCancel: true,
		Name:            l.name,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				term.Lock()
				defer term.Unlock()
				b.log.Info("leading", "work", l.what, "lease", l.namespace+"/"+l.name, "identity", id)
				if l.leading != nil {
					l.leading.Store(true)
					defer l.leading.Store(false)
				}
				l.lead(ctx)
			},
			OnStoppedLeading: func() { b.log.Info("stopped leading", "work", l.what, "lease", l.namespace+"/"+l.name, "identity", id) },
			OnNewLeader: func(holder string) {
				b.log.V(1).Info("new leader", "work", l.what, "lease", l.namespace+"/"+l.name, "holder", holder)
			},
		},
	})
	if err != nil {
		return fmt.Errorf("broker: the Lease of the %s: %w", l.what, err)
	}
	for ctx.Err() == nil {
		elector.Run(ctx)
	}
	if err := context.Cause(ctx); errors.Is(err, errLeaseForbidden) {
		return fmt.Errorf("broker: the %s: the hub refused this replica the Lease %s/%s: %w; grant get, create and update on it (%s)",
			l.what, l.namespace, l.name, err, l.grant)
	}
	return nil
}

var errLeaseForbidden = errors.New("forbidden")

// forbiddenLock is a Lease lock that cancels, with errLeaseForbidden, when
// the hub answers 403: client-go's elector only logs its errors, and
// campaigns forever. It tells reached, when set, of each read and write.
type forbiddenLock struct {
	resourcelock.Interface
	cancel  context.CancelCauseFunc
	reached func(error)
}

func (l *forbiddenLock) check(err error) error {
	if apierrors.IsForbidden(err) {
		l.cancel(fmt.Errorf("%w: %w", errLeaseForbidden, err))
	}
	if l.reached != nil {
		l.reached(err)
	}
	return err
}

func (l *forbiddenLock) Get(ctx context.Context) (*resourcelock.LeaderElectionRecord, []byte, error) {
	r, raw, err := l.Interface.Get(ctx)
	if apierrors.IsNotFound(err) {
		// No Lease yet: Create, which comes next, tells whether the hub
		// lets this replica reach it.
		return r, raw, err
	}
	return r, raw, l.check(err)
}

func (l *forbiddenLock) Create(ctx context.Context, r resourcelock.LeaderElectionRecord) error {
	return l.check(l.Interface.Create(ctx, r))
}

func (l *forbiddenLock) Update(ctx context.Context, r resourcelock.LeaderElectionRecord) error {
	return l.check(l.Interface.Update(ctx, r))
}

// runTriggers runs the revocation triggers on the one replica that holds
// the Lease TriggerLeaseName, or on this replica alone when it is empty.
func (b *Broker) runTriggers(ctx context.Context) error {
	lead := func(ctx context.Context) { _ = b.triggers.Lead(ctx) }
	if b.cfg.TriggerLeaseName == "" {
		b.leadsTriggers.Store(true)
		lead(ctx)
		return nil
	}
	return b.campaign(ctx, lease{
		namespace: b.cfg.PendingRevokesNamespace, name: b.cfg.TriggerLeaseName,
		what: "revocation triggers", grant: "deploy/hub/rbac.yaml, or run one replica with --trigger-lease-name=\"\"",
		lead: lead, leading: &b.leadsTriggers, reach: &b.triggersLease,
	})
}

// triggersLeaseReached is a readiness check: it fails once every read and
// write of the triggers' Lease has failed for a Lease's duration, so that
// a broker whose revocation triggers cannot run on any replica (its
// namespace is missing, say) stops taking exchanges, which would mint
// tokens that nothing revokes when hub RBAC changes, and says why.
func (b *Broker) triggersLeaseReached() error {
	err := b.triggersLease.failing(b.cfg.Clock.Now(), leaseDuration)
	if err == nil {
		return nil
	}
	return fmt.Errorf("the revocation triggers cannot run: no replica can read or write their Lease %s/%s for %s: %w; "+
		"create the namespace %q (--pending-revokes-namespace), or run one replica with --trigger-lease-name=\"\"",
		b.cfg.PendingRevokesNamespace, b.cfg.TriggerLeaseName, leaseDuration, err, b.cfg.PendingRevokesNamespace)
}

// triggersLeader is the gauge of whether this replica runs the revocation
// triggers.
func triggersLeader(b *Broker) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: "credbroker",
		Name:      "revocation_triggers_leader",
		Help: "1 while this replica runs the revocation triggers (it holds their Lease, or --trigger-lease-name is empty), else 0; " +
			"summed over the replicas, 1.",
	}, func() float64 {
		if b.leadsTriggers.Load() {
			return 1
		}
		return 0
	})
}
