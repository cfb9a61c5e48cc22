package grants

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants/selector"
)

// Revoker asks the agent of cluster to delete the grants of ids, and returns
// the ids whose grants are gone: deleted now, or before. Errors wrap
// errdefs sentinels; ErrUnavailable when no agent of cluster is connected.
// The broker passes the tunnel server.
type Revoker interface {
	Revoke(ctx context.Context, cluster fleet.ClusterRef, ids []string, reason string) ([]string, error)
}

// RegistryConfig configures a Registry.
type RegistryConfig struct {
	// Revoker reaches the agents; required.
	Revoker Revoker
	// Clock drops grants, and what is known of revoked ones, once their
	// tokens expire. Default: the real clock.
	Clock clock.PassiveClock
	// Pending, when set, records the revokes that no agent confirmed, for
	// every broker replica to send again (a *PendingStore). Nil: they live
	// in this replica's memory only.
	Pending PendingRecorder
	// The bounds of what the agents of one ClusterProfile may make the
	// registry hold, so that a compromised agent cannot grow the broker's
	// memory: a report that breaks one is refused, and the tunnel closes
	// the agent's stream.
	//
	// MaxGrantsPerCluster bounds the live grants of one ClusterProfile.
	// Default DefaultMaxGrantsPerCluster.
	MaxGrantsPerCluster int
	// MaxGrantBytes bounds one grant, by its protobuf size. Default
	// DefaultMaxGrantBytes.
	MaxGrantBytes int
	// MaxGrantBytesPerCluster bounds what the registry holds for one
	// ClusterProfile: its live grants, each counted as its protobuf size
	// and grantOverhead, and a record of each grant its agents reported
	// deleted, until the grant's token expires. Default
	// DefaultMaxGrantBytesPerCluster.
	MaxGrantBytesPerCluster int
	// MaxGrantLifetime bounds the expiry of a reported grant to now plus
	// MaxGrantLifetime and fleet.MaxClockSkew: no token the broker
	// mints lives longer. The broker passes its MaxExpiration. Default
	// DefaultMaxGrantLifetime.
	MaxGrantLifetime time.Duration
	// RetryInterval is the least time between two sends of one grant's
	// revoke that agents' reports and hellos set off: a stream that
	// reports revoked or pending grants again and again, or reconnects in a
	// loop, makes the broker send each revoke once per RetryInterval at
	// most, and the revokes of one ClusterProfile are sent one request at
	// a time. A send that the interval holds back goes once it has passed,
	// timed by Clock when Clock is a clock.Clock. Default
	// DefaultRetryInterval.
	RetryInterval time.Duration
	// Log receives revocations that failed and refused reports. Default:
	// discard.
	Log logr.Logger
}

// The defaults of RegistryConfig's bounds.
const (
	// DefaultMaxGrantsPerCluster: far more tokens than one cluster's
	// consumers hold at once.
	DefaultMaxGrantsPerCluster = 100000
	// DefaultMaxGrantBytes is the largest grant an agent reports: the
	// agent's Client leaves out a grant that does not fit alone in its
	// 32 KiB frames.
	DefaultMaxGrantBytes = 32 << 10
	// DefaultMaxGrantBytesPerCluster holds some 50,000 grants of a typical
	// size (about 400 bytes and grantOverhead each).
	DefaultMaxGrantBytesPerCluster = 32 << 20
	// DefaultMaxGrantLifetime is the broker's default maximum expiration.
	DefaultMaxGrantLifetime = time.Hour
	// DefaultRetryInterval is the tunnel's default mint timeout: the
	// longest a revoke waits for one agent stream's answer.
	DefaultRetryInterval = 10 * time.Second
)

// MaxCredentialIDBytes bounds a reported grant's credential id: "JTI="
// and a JTI of at most 128 bytes, as a selector may name it.
const MaxCredentialIDBytes = len("JTI=") + selector.MaxJTILength

// What the registry counts against MaxGrantBytesPerCluster besides a
// grant's protobuf size: its record and index entries (grantOverhead), and
// for a revoked grant, its credential id and revokedOverhead.
const (
	grantOverhead   = 256
	revokedOverhead = 128
)

// Registry holds the live grants of the fleet as the agents report them,
// and revokes them. It is safe for concurrent use. Every lookup is indexed
// (by credential id, ClusterProfile and username), so that a reader copies
// only what it returns, and expiry takes the expired records off a queue;
// the lock that Revoked, on every exchange, takes is held only for that.
type Registry struct {
	cfg RegistryConfig

	mu sync.RWMutex
	// live holds the live grants by credential id, also indexed by
	// ClusterProfile and by username; use counts them by ClusterProfile.
	live      map[string]*record
	byCluster map[types.NamespacedName]map[string]*record
	byUser    map[string]map[string]*record
	use       map[types.NamespacedName]*usage
	// lastExpire is when expire last scanned pending.
	lastExpire time.Time
	// revoked holds the grants revoked through this replica or reported
	// deleted by an agent, by credential id, until their tokens expire.
	revoked map[string]*record
	// liveQueue and revokedQueue order live and revoked by expiry.
	liveQueue, revokedQueue expiryQueue
	// pending holds the revokes that have not reached an agent, by
	// credential id.
	pending map[string]pendingRevoke
	// retries holds, by ClusterProfile, the revokes that reports, hellos
	// and Learn asked to send again; a ClusterProfile has an entry while
	// its one sender (sendRetries) runs.
	retries map[types.NamespacedName]*retryQueue
	// sent is when sendRetries last sent the revoke of a credential id,
	// for RetryInterval.
	sent map[string]time.Time
}

// NewRegistry returns an empty Registry.
func NewRegistry(cfg RegistryConfig) (*Registry, error) {
	if cfg.Revoker == nil {
		return nil, fmt.Errorf("grants: Revoker is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	cfg.MaxGrantsPerCluster = orDefault(cfg.MaxGrantsPerCluster, DefaultMaxGrantsPerCluster)
	cfg.MaxGrantBytes = orDefault(cfg.MaxGrantBytes, DefaultMaxGrantBytes)
	cfg.MaxGrantBytesPerCluster = orDefault(cfg.MaxGrantBytesPerCluster, DefaultMaxGrantBytesPerCluster)
	cfg.MaxGrantLifetime = orDefault(cfg.MaxGrantLifetime, DefaultMaxGrantLifetime)
	cfg.RetryInterval = orDefault(cfg.RetryInterval, DefaultRetryInterval)
	return &Registry{
		cfg:       cfg,
		live:      map[string]*record{},
		byCluster: map[types.NamespacedName]map[string]*record{},
		byUser:    map[string]map[string]*record{},
		use:       map[types.NamespacedName]*usage{},
		revoked:   map[string]*record{},
		pending:   map[string]pendingRevoke{},
		retries:   map[types.NamespacedName]*retryQueue{},
		sent:      map[string]time.Time{},
	}, nil
}

// orDefault returns v when it is positive, else def: what New does with a
// Config field left zero or set negative.
func orDefault[T ~int | ~int64 | ~float64](v, def T) T {
	if v > 0 {
		return v
	}
	return def
}
