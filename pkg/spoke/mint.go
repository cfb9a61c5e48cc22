package spoke

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/token"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Minting one token: Mint checks the request and the policy (policy.go),
// then binds the token to a pooled grant and claims it after the answer
// (claim.go); or, when none is ready, creates the grant, checks the policy
// again, then mints the token bound to the grant and records its
// credential id on the grant.

// Mint mints a token for the ServiceAccount that req names, or, when it
// names none, for the single ServiceAccount that allows req's subject. The
// ServiceAccount must list the subject's username, or one of its groups
// after GroupSubjectPrefix, in its AllowedSubjectsAnnotation, and every audience req asks for in its
// AllowedAudiencesAnnotation. Errors wrap a sentinel from package errdefs:
// ErrInvalidArgument for a malformed request, or one whose grant would be
// too large to report to the brokers (fleet.MaxGrantBytes), ErrNotFound for a missing
// ServiceAccount, ErrPermissionDenied when no ServiceAccount allows the
// subject or the ServiceAccount does not allow an audience,
// ErrFailedPrecondition when several allow the subject and req names none, and
// ErrUnavailable when the spoke API server fails or refuses the agent.
// ErrPermissionDenied also refuses a ServiceAccount that may create
// ServiceAccount tokens or impersonate, unless Config.AllowEscalating
// allows it; when the spoke API server cannot say whether it may, Mint
// fails with ErrUnavailable. Each
// token is bound to a grant Secret, a pooled one or one created first (see
// the package doc); Mint fails rather than mint a token without one.
func (m *Minter) Mint(ctx context.Context, cluster fleet.ClusterRef, req *credbrokerv1alpha1.MintRequest) (*credbrokerv1alpha1.MintResponse, error) {
	if err := validate(req); err != nil {
		m.log.Info("refused mint request", fleet.LogSubject, req.GetSubject().GetUsername(), fleet.LogErr, err.Error())
		return nil, err
	}
	user := req.GetSubject().GetUsername()
	sa, err := m.authorize(ctx, req)
	if err != nil {
		m.log.Info("refused mint request", fleet.LogSubject, user, fleet.LogErr, err.Error())
		return nil, err
	}
	ref := sa.Namespace + "/" + sa.Name
	seconds := m.expirationSeconds(req.GetExpirationSeconds())
	info := m.grantInfo(cluster, req, sa, seconds)
	if err := m.checkReportable(info); err != nil {
		m.log.Info("refused mint request", fleet.LogSubject, user, fleet.LogErr, err.Error())
		return nil, err
	}
	if pooled := m.takePooled(sa); pooled != nil {
		tok, err := m.mintPooled(ctx, req, info, pooled, seconds)
		if !errors.Is(err, errPooledGone) {
			return m.answer(req, info, pooled, tok, err)
		}
	}
	grant, err := m.createGrant(ctx, info)
	if err != nil {
		m.log.Error(err, "failed to mint spoke token", fleet.LogSubject, user, "serviceAccount", ref)
		return nil, err
	}
	// Check the policy again now that the grant exists: a change the cache
	// took since pick shows here. A later one queues a Reconcile, and so
	// does this grant's arrival in the grant cache: whichever of the two
	// reaches the agent last, its Reconcile sees both and revokes it.
	if err := m.recheck(sa, grant); err != nil {
		m.deleteGrant(ctx, grant)
		m.log.Info("refused mint request", fleet.LogSubject, user, fleet.LogErr, err.Error())
		return nil, err
	}
	tok, err := m.mintBound(ctx, req, sa, grant, seconds)
	if err == nil {
		m.track(grant, tok.exp)
	}
	return m.answer(req, info, grant, tok, err)
}

// answer logs the mint of tok for req, bound to grant, or its failure err,
// and returns Mint's answer.
func (m *Minter) answer(req *credbrokerv1alpha1.MintRequest, info grantInfo, grant *corev1.Secret, tok mintedToken, err error) (*credbrokerv1alpha1.MintResponse, error) {
	sa := info.serviceAccount
	ref, grantRef := sa.Namespace+"/"+sa.Name, sa.Namespace+"/"+grant.Name
	if err != nil {
		m.log.Error(err, "failed to mint spoke token", fleet.LogSubject, info.hubUser, "serviceAccount", ref, "grant", grantRef)
		return nil, err
	}
	m.log.Info("minted spoke token",
		fleet.LogSubject, info.hubUser,
		"serviceAccount", ref,
		"audiences", req.GetAudiences(),
		"expiration", tok.exp.UTC().Format(time.RFC3339),
		fleet.LogCredentialID, tok.id,
		"grant", grantRef,
		"clusterProfile", info.clusterProfile,
	)
	return &credbrokerv1alpha1.MintResponse{
		Token:          tok.token,
		ExpirationTime: timestamppb.New(tok.exp),
		ServiceAccount: &credbrokerv1alpha1.ObjectReference{Namespace: sa.Namespace, Name: sa.Name},
	}, nil
}

// grantInfo returns what the grant of req's token for sa records: the hub
// subject, the ClusterProfile the request came through, the audiences, and
// the latest the token of seconds can expire.
func (m *Minter) grantInfo(cluster fleet.ClusterRef, req *credbrokerv1alpha1.MintRequest, sa *corev1.ServiceAccount, seconds int64) grantInfo {
	return grantInfo{
		serviceAccount: sa,
		hubUser:        req.GetSubject().GetUsername(),
		hubUID:         req.GetSubject().GetUid(),
		hubGroups:      req.GetSubject().GetGroups(),
		clusterProfile: profileName(cluster),
		clusterUID:     string(cluster.UID),
		audiences:      req.GetAudiences(),
		// The latest the token can expire; mintBound records when it
		// does.
		expiration: m.clock.Now().Add(time.Duration(seconds) * time.Second),
	}
}

// checkReportable refuses the mint that info describes when its grant
// would be larger than an agent reports to the brokers: no broker could
// list or revoke its token. Only a hub subject's groups grow that large in
// practice.
func (m *Minter) checkReportable(info grantInfo) error {
	n := proto.Size(m.toGrant(newGrant(info)))
	if n <= fleet.MaxGrantBytes {
		return nil
	}
	return fmt.Errorf("the grant of a token for spoke ServiceAccount %s/%s would report %d bytes, more than the %d an agent reports to the brokers, "+
		"so no broker could list or revoke the token; the hub subject is in %d groups: %w",
		info.serviceAccount.Namespace, info.serviceAccount.Name, n, fleet.MaxGrantBytes, len(info.hubGroups), errdefs.ErrInvalidArgument)
}

// errNoNameOrUID is the error of a grant create that returned no object
// to bind a token to.
var errNoNameOrUID = errors.New("the API server returned no name or UID")

// createGrant creates the grant that info describes, which the token is
// then bound to.
func (m *Minter) createGrant(ctx context.Context, info grantInfo) (*corev1.Secret, error) {
	grant, err := m.grants.Create(ctx, newGrant(info))
	if err == nil && (grant == nil || grant.Name == "" || grant.UID == "") {
		err = errNoNameOrUID
	}
	if err != nil {
		return nil, createGrantError(ctx, info.serviceAccount.Namespace, err)
	}
	return grant, nil
}

// mintedToken is a token Mint hands out: the token, when it expires, and
// its credential id.
type mintedToken struct {
	token string
	exp   time.Time
	id    string
}

// mintBound mints the token of sa, bound to grant, for req and seconds,
// and records its credential id and expiry on grant. When either fails it
// deletes grant, which revokes a token minted already.
func (m *Minter) mintBound(ctx context.Context, req *credbrokerv1alpha1.MintRequest, sa *corev1.ServiceAccount, grant *corev1.Secret, seconds int64) (mintedToken, error) {
	out, err := m.requestToken(ctx, req, sa, grant, seconds)
	if errors.Is(err, errBoundGrantGone) {
		err = m.revokedDuringMint(sa, grant)
	}
	if err != nil {
		m.deleteGrant(ctx, grant)
		return mintedToken{}, err
	}
	tok := m.mintedOf(out, seconds)
	patch, err := mintedPatch(tok.id, sha256.Sum256([]byte(tok.token)), tok.exp)
	if err == nil {
		err = m.grants.Patch(ctx, sa.Namespace, grant.Name, patch)
	}
	if err != nil {
		// A grant without its credential id cannot be traced; revoke the
		// token by deleting it rather than hand it out.
		m.deleteGrant(ctx, grant)
		if grantDeleted(err) {
			return mintedToken{}, m.revokedDuringMint(sa, grant)
		}
		return mintedToken{}, fmt.Errorf("record credential id %s on grant %s/%s: %v: %w", tok.id, sa.Namespace, grant.Name, err, errdefs.ErrUnavailable)
	}
	return tok, nil
}

// errBoundGrantGone is requestToken's error when the grant to bind the
// token to is gone.
var errBoundGrantGone = errors.New("the grant to bind the token to is gone")

// mintedOf returns the token that out, a TokenRequest for seconds,
// minted.
func (m *Minter) mintedOf(out *authenticationv1.TokenRequest, seconds int64) mintedToken {
	tok := mintedToken{token: out.Status.Token, exp: out.Status.ExpirationTimestamp.Time}
	if tok.exp.IsZero() {
		// An API server that leaves it out would have the grant collected,
		// and the token revoked, at once; the token lives no longer than
		// asked.
		tok.exp = m.clock.Now().Add(time.Duration(seconds) * time.Second)
	}
	tok.id = token.ID(tok.token)
	return tok
}

// requestToken asks the TokenRequest API for a token of sa that lives for
// seconds, for req's audiences, bound to grant. Its error wraps a sentinel
// (createTokenError), or is errBoundGrantGone when grant was deleted
// meanwhile.
func (m *Minter) requestToken(ctx context.Context, req *credbrokerv1alpha1.MintRequest, sa *corev1.ServiceAccount, grant *corev1.Secret, seconds int64) (*authenticationv1.TokenRequest, error) {
	ref := sa.Namespace + "/" + sa.Name
	tr := &authenticationv1.TokenRequest{
		// The UID makes the API server refuse with a Conflict if the
		// ServiceAccount was replaced since the informer saw it, so a token is
		// never minted for an object whose annotation was not checked. Only
		// API servers of Kubernetes 1.34 and later enforce it; older ones
		// ignore it.
		ObjectMeta: metav1.ObjectMeta{UID: sa.UID},
		Spec: authenticationv1.TokenRequestSpec{
			Audiences:         slices.Clone(req.GetAudiences()),
			ExpirationSeconds: &seconds,
			// The token lives only as long as its grant.
			BoundObjectRef: &authenticationv1.BoundObjectReference{
				APIVersion: "v1", Kind: "Secret", Name: grant.Name, UID: grant.UID,
			},
		},
	}
	out, err := m.tokens.CreateToken(ctx, sa.Namespace, sa.Name, tr)
	if err == nil && (out == nil || out.Status.Token == "") {
		err = fmt.Errorf("spoke API server returned no token for ServiceAccount %s: %w", ref, errdefs.ErrUnavailable)
	} else if grantDeleted(err) {
		err = errBoundGrantGone
	} else if err != nil {
		err = createTokenError(ctx, ref, err)
	}
	return out, err
}

// validate returns an error wrapping ErrInvalidArgument that lists every
// problem with req.
func validate(req *credbrokerv1alpha1.MintRequest) error {
	if req == nil {
		return fmt.Errorf("mint request is missing: %w", errdefs.ErrInvalidArgument)
	}
	var problems []string
	if req.GetSubject().GetUsername() == "" {
		problems = append(problems, "subject.username is required")
	}
	if ref := req.GetServiceAccount(); ref != nil {
		if ref.GetNamespace() == "" {
			problems = append(problems, "service_account.namespace is required when service_account is set")
		} else if errs := validation.IsDNS1123Label(ref.GetNamespace()); len(errs) > 0 {
			problems = append(problems, fmt.Sprintf("service_account.namespace %q is not a valid namespace name: %s", ref.GetNamespace(), strings.Join(errs, "; ")))
		}
		if ref.GetName() == "" {
			problems = append(problems, "service_account.name is required when service_account is set")
		} else if errs := validation.IsDNS1123Subdomain(ref.GetName()); len(errs) > 0 {
			problems = append(problems, fmt.Sprintf("service_account.name %q is not a valid ServiceAccount name: %s", ref.GetName(), strings.Join(errs, "; ")))
		}
	}
	for i, a := range req.GetAudiences() {
		if a == "" {
			problems = append(problems, fmt.Sprintf("audiences[%d] is empty; omit audiences to get the spoke API server's default", i))
		}
	}
	if s := req.GetExpirationSeconds(); s < 0 {
		problems = append(problems, fmt.Sprintf("expiration_seconds %d is negative; use 0 for the maximum", s))
	}
	if len(problems) > 0 {
		return fmt.Errorf("mint request: %s: %w", strings.Join(problems, "; "), errdefs.ErrInvalidArgument)
	}
	return nil
}

// grantDeleted reports whether err is the spoke API server saying that a
// grant Secret is not found: the TokenRequest's bound object, or the grant
// a patch names. A ServiceAccount that is not found is another answer.
func grantDeleted(err error) bool {
	var status apierrors.APIStatus
	if !apierrors.IsNotFound(err) || !errors.As(err, &status) {
		return false
	}
	d := status.Status().Details
	return d != nil && d.Group == "" && d.Kind == "secrets"
}

// revokedDuringMint returns the error of a mint whose grant was deleted,
// which revokes its token, before the token was handed out: Reconcile
// deleted it because the ServiceAccount changed its policy, which recheck
// then names, or someone revoked it. Either wraps ErrPermissionDenied,
// never ErrNotFound: the ServiceAccount exists.
func (m *Minter) revokedDuringMint(sa *corev1.ServiceAccount, grant *corev1.Secret) error {
	if err := m.recheck(sa, grant); err != nil {
		return err
	}
	return fmt.Errorf("the grant %s/%s of the token for spoke ServiceAccount %s/%s was deleted while the token was minted, which revokes the token; ask again: %w",
		grant.Namespace, grant.Name, sa.Namespace, sa.Name, errdefs.ErrPermissionDenied)
}

// deleteGrant deletes the grant of a mint that failed. It outlives ctx, as
// the mint may have failed because ctx ended; if it fails too, Run collects
// the grant once its expiration passes. It reports whether the grant is
// gone.
func (m *Minter) deleteGrant(ctx context.Context, grant *corev1.Secret) (deleted bool) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if err := m.grants.Delete(ctx, grant.Namespace, grant.Name, grant.UID); err != nil && !gone(err) {
		m.log.Error(err, "failed to delete the grant of a failed mint; it is collected when it expires",
			"grant", grant.Namespace+"/"+grant.Name)
		return false
	}
	return true
}

// createTokenError maps an error of the TokenRequest API to a sentinel. The
// API server's message never contains a token.
func createTokenError(ctx context.Context, ref string, err error) error {
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		// Keep the context error, so the caller sees Canceled or
		// DeadlineExceeded rather than Unavailable.
		return fmt.Errorf("mint token for spoke ServiceAccount %s: %w", ref, err)
	case ctx.Err() != nil:
		return fmt.Errorf("mint token for spoke ServiceAccount %s: %v: %w", ref, err, ctx.Err())
	case apierrors.IsNotFound(err):
		return fmt.Errorf("spoke ServiceAccount %s: %w", ref, errdefs.ErrNotFound)
	case apierrors.IsForbidden(err):
		return fmt.Errorf("spoke API server forbids the agent to mint tokens for ServiceAccount %s; grant the agent's ServiceAccount create on serviceaccounts/token: %v: %w",
			ref, err, errdefs.ErrUnavailable)
	case apierrors.IsConflict(err):
		return fmt.Errorf("spoke ServiceAccount %s was replaced since the agent's cache saw it; retry once the cache catches up: %w", ref, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("mint token for spoke ServiceAccount %s: %v: %w", ref, err, errdefs.ErrUnavailable)
}

// createGrantError maps an error creating a grant to a sentinel: the mint
// fails, as no token is minted without a grant.
func createGrantError(ctx context.Context, namespace string, err error) error {
	const what = "create the grant Secret the token would be bound to"
	switch {
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("%s in namespace %s: %w", what, namespace, err)
	case ctx.Err() != nil:
		return fmt.Errorf("%s in namespace %s: %v: %w", what, namespace, err, ctx.Err())
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "exceeded quota"):
		return fmt.Errorf("the ResourceQuota of namespace %s allows no more Secrets, so the agent cannot %s and no token is minted; "+
			"raise the quota, or lower the agents' --grant-pool-size (the agent that serves the namespace keeps that many ready grants per ServiceAccount it minted for there): %v: %w",
			namespace, what, err, errdefs.ErrResourceExhausted)
	case apierrors.IsForbidden(err):
		return fmt.Errorf("spoke API server forbids the agent to %s in namespace %s, so no token is minted; "+
			"grant the agent's ServiceAccount create on secrets and check the credbroker-agent-grants admission policy: %v: %w",
			what, namespace, err, errdefs.ErrUnavailable)
	}
	return fmt.Errorf("%s in namespace %s, so no token is minted: %v: %w", what, namespace, err, errdefs.ErrUnavailable)
}
