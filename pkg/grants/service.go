package grants

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants/selector"
	"github.com/credbroker/credbroker/pkg/hubauth"
	"github.com/credbroker/credbroker/pkg/store"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Authenticator authenticates the caller of a gRPC call from its metadata.
// Errors wrap errdefs sentinels. The broker passes the exchange service
// (*tokenexchange.Service), so that both services of the exchange port
// authenticate alike.
type Authenticator interface {
	Authenticate(ctx context.Context) (hubauth.User, error)
}

// ServiceConfig configures a Service.
type ServiceConfig struct {
	// Authenticator, AccessReviews and Grants are required.
	Authenticator Authenticator
	AccessReviews AccessReviewer
	Grants        Table
	// ReviewTimeout bounds each SubjectAccessReview. Default 5s.
	ReviewTimeout time.Duration
	// AllowTTL and DenyTTL are how long the hub's answers are kept: a
	// caller's calls within them cost no hub review. Default 10s and 2s,
	// as the exchange's; CacheSize bounds the answers kept, default 10,000.
	AllowTTL, DenyTTL time.Duration
	CacheSize         int
	// RevokeTimeout bounds the revokes of one call, which go on when the
	// caller goes away. Default 30s.
	RevokeTimeout time.Duration
	// Clock times the calls for the audit. Default: the real clock.
	Clock clock.PassiveClock
	// Log receives operational errors, such as failed hub reviews; Audit
	// receives one line per call. Default: discard.
	Log, Audit logr.Logger
}

// Service implements the Grants gRPC service. A caller may always list and
// revoke its own grants, those whose subject has the caller's username and
// UID; other consumers' grants need hub RBAC on
// multicluster.x-k8s.io clusterprofiles/token: list to list them, delete
// to revoke them, on the ClusterProfile that the selector names (or that
// the grant of its credential id belongs to), and otherwise in every
// namespace. A call so costs at most one hub review, whatever other
// consumers hold, and the answers are cached briefly.
type Service struct {
	pb.UnsafeGrantsServer
	cfg       ServiceConfig
	decisions *store.Cache[[sha256.Size]byte, bool]
}

var _ pb.GrantsServer = (*Service)(nil)

// NewService validates cfg, applies defaults and returns a Service.
func NewService(cfg ServiceConfig) (*Service, error) {
	if cfg.Authenticator == nil || cfg.AccessReviews == nil || cfg.Grants == nil {
		return nil, errors.New("grants: Authenticator, AccessReviews and Grants are required")
	}
	if cfg.ReviewTimeout == 0 {
		cfg.ReviewTimeout = 5 * time.Second
	}
	if cfg.RevokeTimeout == 0 {
		cfg.RevokeTimeout = 30 * time.Second
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.AllowTTL <= 0 {
		cfg.AllowTTL = 10 * time.Second
	}
	if cfg.DenyTTL <= 0 {
		cfg.DenyTTL = 2 * time.Second
	}
	if cfg.CacheSize <= 0 {
		cfg.CacheSize = 10000
	}
	decisions, err := store.New[[sha256.Size]byte, bool](store.Config{Size: cfg.CacheSize, MaxTTL: max(cfg.AllowTTL, cfg.DenyTTL), Clock: cfg.Clock})
	if err != nil {
		return nil, fmt.Errorf("grants: %w", err)
	}
	return &Service{cfg: cfg, decisions: decisions}, nil
}

// List implements Grants.List.
func (s *Service) List(ctx context.Context, req *pb.ListGrantsRequest) (*pb.ListGrantsResponse, error) {
	rec := &auditRecord{method: "list", selector: req.GetSelector()}
	return serve(ctx, s, rec, func(user hubauth.User, sel Selector) (*pb.ListGrantsResponse, error) {
		return s.list(ctx, user, sel, rec)
	})
}

// Revoke implements Grants.Revoke.
func (s *Service) Revoke(ctx context.Context, req *pb.RevokeGrantsRequest) (*pb.RevokeGrantsResponse, error) {
	rec := &auditRecord{method: "revoke", selector: req.GetSelector(), reason: req.GetReason()}
	return serve(ctx, s, rec, func(user hubauth.User, sel Selector) (*pb.RevokeGrantsResponse, error) {
		return s.revoke(ctx, user, sel, req.GetReason(), rec)
	})
}

// serve authenticates the caller, parses rec's selector, calls do, writes
// rec's audit line, and returns do's answer or its error as a gRPC status.
func serve[T any](ctx context.Context, s *Service, rec *auditRecord, do func(hubauth.User, Selector) (T, error)) (T, error) {
	start := s.cfg.Clock.Now()
	resp, err := func() (T, error) {
		var none T
		user, err := s.cfg.Authenticator.Authenticate(ctx)
		if err != nil {
			return none, err
		}
		rec.user = &user
		sel, err := parseSelector(rec.selector)
		if err != nil {
			return none, err
		}
		return do(user, sel)
	}()
	s.audit(rec, err, s.cfg.Clock.Since(start))
	if err != nil {
		var none T
		return none, errdefs.ToStatus(err).Err()
	}
	return resp, nil
}

func (s *Service) list(ctx context.Context, user hubauth.User, sel Selector, rec *auditRecord) (*pb.ListGrantsResponse, error) {
	var out []*pb.Grant
	if ownSelection(user, sel) {
		// Cheap to read: one grant, or the grants of the caller's
		// username. Others' among them need the review.
		matched := s.cfg.Grants.Select(sel)
		foreign := others(user, matched)
		// Nothing found costs the review too, so that the answer is
		// the same whether others' grants match or nothing does.
		allowed := len(foreign) == 0 && len(matched) > 0
		if !allowed {
			var err error
			if allowed, err = s.review(ctx, user, hubauth.VerbList, scopeOf(sel, foreign)); err != nil {
				return nil, err
			}
		}
		for _, g := range matched {
			if allowed || Owns(user, g) {
				out = append(out, g)
			}
		}
	} else {
		// Others' grants may be many: the review comes first, and
		// without it only the caller's own are read.
		allowed, err := s.review(ctx, user, hubauth.VerbList, scopeOf(sel, nil))
		if err != nil {
			return nil, err
		}
		if allowed {
			out = s.cfg.Grants.Select(sel)
		} else {
			out = s.owned(user, sel)
		}
	}
	rec.listed = len(out)
	return &pb.ListGrantsResponse{Grants: out}, nil
}

func (s *Service) revoke(ctx context.Context, user hubauth.User, sel Selector, requestedReason string, rec *auditRecord) (*pb.RevokeGrantsResponse, error) {
	if sel.IsZero() {
		return nil, fmt.Errorf("a revoke must select grants by credential id, username or cluster; "+
			"to revoke every grant of a cluster, name the cluster: %w", errdefs.ErrInvalidArgument)
	}
	reason, err := parseReason(requestedReason, user)
	if err != nil {
		return nil, err
	}
	// A selector that is not zero names a credential id, a username or a
	// ClusterProfile: reading what it matches costs what it returns.
	matched := s.cfg.Grants.Select(sel)
	foreign := others(user, matched)
	// All or nothing: every grant that is not the caller's needs delete,
	// else nothing is revoked. A caller without it gets the same answer
	// whether others' grants match or nothing does.
	if len(foreign) > 0 || !slices.ContainsFunc(matched, func(g *pb.Grant) bool { return Owns(user, g) }) {
		scope := scopeOf(sel, foreign)
		allowed, err := s.review(ctx, user, hubauth.VerbDelete, scope)
		if err != nil {
			return nil, err
		}
		if !allowed {
			return nil, fmt.Errorf("hub RBAC does not allow %q to %s %s.%s/%s %s, which revoking grants that are not yours needs; "+
				"without it you may revoke only your own grants, and %s matches others' grants or none of yours; nothing was revoked: %w",
				user.Username, hubauth.VerbDelete, hubauth.Resource, hubauth.Group, hubauth.Subresource, scope.describe(sel), describe(sel), errdefs.ErrPermissionDenied)
		}
	}
	if len(matched) == 0 {
		return nil, fmt.Errorf("no live grant matches %s; list the live grants with 'credbroker grants list': %w",
			describe(sel), errdefs.ErrNotFound)
	}
	// The revokes go on if the caller goes away: a half-delivered revoke
	// stays pending in the registry anyway.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.RevokeTimeout)
	defer cancel()
	// A pending revoke is acknowledged only once it is recorded for every
	// replica to send again: one that only this replica remembers would be
	// lost with it.
	revoked, pending, err := s.cfg.Grants.RevokeRecorded(rctx, matched, reason)
	rec.revoked, rec.pending = credentialIDs(revoked), credentialIDs(pending)
	if err != nil {
		return nil, err
	}
	return &pb.RevokeGrantsResponse{Revoked: revoked, Pending: pending}, nil
}

// ownSelection reports whether what sel matches is cheap to read before
// any review: one grant, by its credential id, or the grants of the
// caller's own username.
func ownSelection(user hubauth.User, sel Selector) bool {
	return sel.CredentialID != "" || (sel.Username != "" && sel.Username == user.Username)
}

// owned returns the grants of user that sel matches, read through the
// registry's index of user's username.
func (s *Service) owned(user hubauth.User, sel Selector) []*pb.Grant {
	if sel.Username != "" && sel.Username != user.Username {
		return nil
	}
	sel.Username = user.Username
	var out []*pb.Grant
	for _, g := range s.cfg.Grants.Select(sel) {
		if Owns(user, g) {
			out = append(out, g)
		}
	}
	return out
}

// Owns reports whether g was minted for user: its subject has user's
// username and UID. A ServiceAccount deleted and created again under the
// same name has another UID and owns none of its predecessor's grants; a
// user without a UID owns none.
func Owns(user hubauth.User, g *pb.Grant) bool {
	return user.UID != "" && g.GetSubject().GetUid() == user.UID && g.GetSubject().GetUsername() == user.Username
}

func clusterOf(g *pb.Grant) types.NamespacedName {
	return types.NamespacedName{Namespace: g.GetCluster().GetNamespace(), Name: g.GetCluster().GetName()}
}

// others returns the grants of gs that user does not own.
func others(user hubauth.User, gs []*pb.Grant) []*pb.Grant {
	var out []*pb.Grant
	for _, g := range gs {
		if !Owns(user, g) {
			out = append(out, g)
		}
	}
	return out
}

// scope is what one review asks about: one ClusterProfile, or, when zero,
// clusterprofiles/token in every namespace.
type scope types.NamespacedName

// scopeOf is the scope of the review that others' grants selected by sel
// need: the ClusterProfile that sel names; for a credential id, the
// ClusterProfile of its grant, foreign (at most one); else every
// namespace. It never depends on how many grants others hold.
func scopeOf(sel Selector, foreign []*pb.Grant) scope {
	switch {
	case sel.Cluster.Name != "":
		return scope(sel.Cluster)
	case sel.CredentialID != "" && len(foreign) > 0:
		return scope(clusterOf(foreign[0]))
	default:
		return scope{}
	}
}

// describe names the scope for a caller who sent sel: the ClusterProfile
// when sel named it, else only the kind of scope, so that the answer does
// not tell where a grant that is not the caller's lives. For a credential
// id, it is the same words whether the id's grant exists (the review asks
// about its ClusterProfile) or not (every namespace): the answer must not
// tell a caller without rights which ids are live.
func (c scope) describe(sel Selector) string {
	switch {
	case sel.Cluster.Name != "":
		return fmt.Sprintf("%q in namespace %q", c.Name, c.Namespace)
	case sel.CredentialID != "":
		return "on the ClusterProfile of the grant it names"
	default:
		return "in every namespace"
	}
}

// review asks the hub whether user may verb clusterprofiles/token in c,
// once per user, verb and scope while its answer is fresh (AllowTTL,
// DenyTTL): concurrent calls share one review. A review the hub does not
// answer fails the call: the service fails closed.
func (s *Service) review(ctx context.Context, user hubauth.User, verb string, c scope) (bool, error) {
	key, err := json.Marshal([]any{user, verb, c.Namespace, c.Name})
	if err != nil {
		return false, fmt.Errorf("grants: review cache key: %w", err)
	}
	sum := sha256.Sum256(key)
	allowed, _, err := s.decisions.Do(ctx, sum, func(ctx context.Context) (bool, time.Time, error) {
		now := s.cfg.Clock.Now()
		rctx, cancel := context.WithTimeout(ctx, s.cfg.ReviewTimeout)
		defer cancel()
		answer, err := s.cfg.AccessReviews.Create(rctx, hubauth.AccessReview(user, verb, types.NamespacedName(c)), metav1.CreateOptions{})
		if err != nil {
			return false, time.Time{}, s.hubFailure(err)
		}
		if hubauth.Allowed(answer) {
			return true, now.Add(s.cfg.AllowTTL), nil
		}
		return false, now.Add(s.cfg.DenyTTL), nil
	})
	return allowed, err
}

// hubFailure describes a failed SubjectAccessReview for the caller; the
// full error, which may name the hub's address, goes to the log.
func (s *Service) hubFailure(err error) error {
	s.cfg.Log.Error(err, "hub review failed", fleet.LogReview, "SubjectAccessReview")
	reason := "the hub API server did not answer"
	var st apierrors.APIStatus
	if errors.As(err, &st) {
		reason = fmt.Sprintf("%s (%d)", st.Status().Reason, st.Status().Code)
	} else if errors.Is(err, context.DeadlineExceeded) {
		reason = "the hub API server did not answer in time"
	}
	return fmt.Errorf("hub SubjectAccessReview failed: %s: %w", reason, errdefs.ErrUnavailable)
}

// maxReasonLength bounds a revoke's reason.
const maxReasonLength = 256

// parseSelector checks the wire form of a selector (selector.Check) and
// converts it.
func parseSelector(s *pb.GrantSelector) (Selector, error) {
	if err := selector.Check(s); err != nil {
		return Selector{}, err
	}
	return SelectorOf(s), nil
}

// parseReason checks a revoke's reason; without one, the reason names the
// caller.
func parseReason(reason string, user hubauth.User) (string, error) {
	if len(reason) > maxReasonLength || strings.ContainsFunc(reason, selector.IsControl) {
		return "", fmt.Errorf("the reason must be at most %d bytes without control characters: %w", maxReasonLength, errdefs.ErrInvalidArgument)
	}
	if strings.TrimSpace(reason) == "" {
		return "revoked by " + user.Username, nil
	}
	return reason, nil
}

// describe names what s selects, for messages.
func describe(s Selector) string {
	var parts []string
	if s.CredentialID != "" {
		parts = append(parts, "credential id "+s.CredentialID)
	}
	if s.Username != "" {
		parts = append(parts, fmt.Sprintf("user %q", selector.Clip(s.Username)))
	}
	if s.Cluster != (types.NamespacedName{}) {
		parts = append(parts, "ClusterProfile "+s.Cluster.String())
	}
	return strings.Join(parts, ", ")
}

func credentialIDs(gs []*pb.Grant) []string {
	out := make([]string, len(gs))
	for i, g := range gs {
		out[i] = g.GetCredentialId()
	}
	return out
}
