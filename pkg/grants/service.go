package grants

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"golang.org/x/sync/errgroup"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/hubauth"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The verbs on multicluster.x-k8s.io clusterprofiles/token that let a caller
// list and revoke other consumers' grants of a ClusterProfile.
const (
	VerbList   = "list"
	VerbDelete = "delete"
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
// multicluster.x-k8s.io clusterprofiles/token of their ClusterProfile:
// list to list them, delete to revoke them.
type Service struct {
	pb.UnsafeGrantsServer
	cfg ServiceConfig
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
	return &Service{cfg: cfg}, nil
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
	matched := s.cfg.Grants.Select(sel)
	allowed, err := s.review(ctx, user, VerbList, others(user, matched))
	if err != nil {
		return nil, err
	}
	var out []*pb.Grant
	for _, g := range matched {
		if Owns(user, g) || allowed[clusterOf(g)] {
			out = append(out, g)
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
	matched := s.cfg.Grants.Select(sel)
	if len(matched) == 0 {
		return nil, fmt.Errorf("no live grant matches %s; list the live grants with 'credbroker grants list': %w",
			describe(sel), errdefs.ErrNotFound)
	}
	// All or nothing: every grant that is not the caller's needs delete on
	// its ClusterProfile, else nothing is revoked.
	foreign := others(user, matched)
	allowed, err := s.review(ctx, user, VerbDelete, foreign)
	if err != nil {
		return nil, err
	}
	for _, c := range sortedClusters(foreign) {
		if !allowed[c] {
			return nil, fmt.Errorf("%d of the matching grants of ClusterProfile %s are not yours, and hub RBAC does not allow %q to %s "+
				"%s.%s/%s %q in namespace %q, which revoking them needs; nothing was revoked: %w",
				len(foreign[c]), c, user.Username, VerbDelete, hubauth.Resource, hubauth.Group, hubauth.Subresource,
				c.Name, c.Namespace, errdefs.ErrPermissionDenied)
		}
	}
	// The revokes go on if the caller goes away: a half-delivered revoke
	// stays pending in the registry anyway.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.RevokeTimeout)
	defer cancel()
	revoked, pending := s.cfg.Grants.Revoke(rctx, matched, reason)
	rec.revoked, rec.pending = credentialIDs(revoked), credentialIDs(pending)
	return &pb.RevokeGrantsResponse{Revoked: revoked, Pending: pending}, nil
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

// others returns the grants of gs that user does not own, by ClusterProfile.
func others(user hubauth.User, gs []*pb.Grant) map[types.NamespacedName][]*pb.Grant {
	out := map[types.NamespacedName][]*pb.Grant{}
	for _, g := range gs {
		if !Owns(user, g) {
			out[clusterOf(g)] = append(out[clusterOf(g)], g)
		}
	}
	return out
}

func sortedClusters[V any](m map[types.NamespacedName]V) []types.NamespacedName {
	out := make([]types.NamespacedName, 0, len(m))
	for c := range m {
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b types.NamespacedName) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	return out
}

// reviewConcurrency bounds the SubjectAccessReviews of one call in flight.
const reviewConcurrency = 8

// review asks the hub, once per ClusterProfile of clusters, whether user
// may verb its clusterprofiles/token, and returns the allowed ones. A
// review the hub does not answer fails the call: the service fails closed.
func (s *Service) review(ctx context.Context, user hubauth.User, verb string, clusters map[types.NamespacedName][]*pb.Grant) (map[types.NamespacedName]bool, error) {
	allowed := make(map[types.NamespacedName]bool, len(clusters))
	var mu sync.Mutex
	g, ctx := errgroup.WithContext(ctx)
	g.SetLimit(reviewConcurrency)
	for _, c := range sortedClusters(clusters) {
		g.Go(func() error {
			rctx, cancel := context.WithTimeout(ctx, s.cfg.ReviewTimeout)
			defer cancel()
			answer, err := s.cfg.AccessReviews.Create(rctx, hubauth.AccessReview(user, verb, c), metav1.CreateOptions{})
			if err != nil {
				return s.hubFailure(err)
			}
			mu.Lock()
			allowed[c] = hubauth.Allowed(answer)
			mu.Unlock()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return allowed, nil
}

// hubFailure describes a failed SubjectAccessReview for the caller; the
// full error, which may name the hub's address, goes to the log.
func (s *Service) hubFailure(err error) error {
	s.cfg.Log.Error(err, "hub review failed", "review", "SubjectAccessReview")
	reason := "the hub API server did not answer"
	var st apierrors.APIStatus
	if errors.As(err, &st) {
		reason = fmt.Sprintf("%s (%d)", st.Status().Reason, st.Status().Code)
	} else if errors.Is(err, context.DeadlineExceeded) {
		reason = "the hub API server did not answer in time"
	}
	return fmt.Errorf("hub SubjectAccessReview failed: %s: %w", reason, errdefs.ErrUnavailable)
}

// Limits of what a selector and a reason may hold.
const (
	maxUsernameLength = 1024
	maxReasonLength   = 256
	maxJTILength      = 128
)

// ParseSelector validates the wire form of a selector: a credential id of
// the form "JTI=<jti>", a username without control characters, and a
// cluster with both a namespace (an RFC 1123 label) and a name (an RFC 1123
// subdomain). Errors wrap errdefs.ErrInvalidArgument.
func ParseSelector(s *pb.GrantSelector) (Selector, error) { return parseSelector(s) }

func parseSelector(s *pb.GrantSelector) (Selector, error) {
	var errs []string
	if id := s.GetCredentialId(); id != "" {
		jti, ok := strings.CutPrefix(id, "JTI=")
		if !ok || jti == "" || len(jti) > maxJTILength || strings.ContainsFunc(jti, notVisibleASCII) {
			errs = append(errs, fmt.Sprintf("credential id %q is not of the form JTI=<jti> (1 to %d printable ASCII characters), as 'credbroker grants list' shows it",
				clip(id), maxJTILength))
		}
	}
	if u := s.GetUsername(); u != "" {
		if len(u) > maxUsernameLength || strings.ContainsFunc(u, isControl) || strings.TrimSpace(u) != u {
			errs = append(errs, fmt.Sprintf("username %q is longer than %d bytes, or has control characters or surrounding spaces", clip(u), maxUsernameLength))
		}
	}
	if c := s.GetCluster(); c != nil {
		switch {
		case c.GetNamespace() == "" || c.GetName() == "":
			errs = append(errs, fmt.Sprintf("cluster %q needs both a namespace and a name", clip(c.GetNamespace()+"/"+c.GetName())))
		case len(validation.IsDNS1123Label(c.GetNamespace())) > 0:
			errs = append(errs, fmt.Sprintf("cluster namespace %q is not a valid namespace (an RFC 1123 label)", clip(c.GetNamespace())))
		case len(validation.IsDNS1123Subdomain(c.GetName())) > 0:
			errs = append(errs, fmt.Sprintf("cluster name %q is not a valid ClusterProfile name (an RFC 1123 subdomain)", clip(c.GetName())))
		}
	}
	if len(errs) > 0 {
		return Selector{}, fmt.Errorf("invalid selector: %s: %w", strings.Join(errs, "; "), errdefs.ErrInvalidArgument)
	}
	return SelectorOf(s), nil
}

// parseReason checks a revoke's reason; without one, the reason names the
// caller.
func parseReason(reason string, user hubauth.User) (string, error) {
	if len(reason) > maxReasonLength || strings.ContainsFunc(reason, isControl) {
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
		parts = append(parts, fmt.Sprintf("user %q", clip(s.Username)))
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

func notVisibleASCII(r rune) bool { return r <= ' ' || r > '~' }

func isControl(r rune) bool { return r < 0x20 || r == 0x7f }

// clip shortens what a caller sent for messages and logs, and replaces
// anything shaped like a bearer token with its fingerprint: a caller who
// pastes a token into a field must not find it in the audit log.
func clip(s string) string {
	if token.CheckShape(s) == nil {
		return token.Fingerprint(s)
	}
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
