package grants

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/hubauth"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// fakeAuthn authenticates every call as user, or fails with err.
type fakeAuthn struct {
	user hubauth.User
	err  error
}

func (f fakeAuthn) Authenticate(context.Context) (hubauth.User, error) { return f.user, f.err }

// fakeSAR allows what its rules list, as "<verb> <namespace>/<name>", for
// every user, and records every review.
type fakeSAR struct {
	mu      sync.Mutex
	rules   map[string]bool
	err     error
	reviews []*authorizationv1.SubjectAccessReview
}

func (f *fakeSAR) Create(_ context.Context, r *authorizationv1.SubjectAccessReview, _ metav1.CreateOptions) (*authorizationv1.SubjectAccessReview, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reviews = append(f.reviews, r)
	if f.err != nil {
		return nil, f.err
	}
	a := r.Spec.ResourceAttributes
	out := r.DeepCopy()
	out.Status.Allowed = f.rules[a.Verb+" "+a.Namespace+"/"+a.Name]
	return out, nil
}

var (
	userA = hubauth.User{Username: "system:serviceaccount:team-a:app", UID: "uid-a", Groups: []string{"system:serviceaccounts"},
		Extra: map[string]authenticationv1.ExtraValue{"authentication.kubernetes.io/pod-name": {"app-0"}}}
	// userARecreated has A's name but another UID: its ServiceAccount was
	// deleted and created again.
	userARecreated = hubauth.User{Username: userA.Username, UID: "uid-a-2"}
	userB          = hubauth.User{Username: "system:serviceaccount:team-b:app", UID: "uid-b"}
)

// grantOf returns a grant of user on cluster.
func grantOf(id string, user hubauth.User, cluster fleet.ClusterRef) *pb.Grant {
	g := grant(id, user.Username, time.Hour)
	g.Subject.Uid = user.UID
	return on(cluster, g)[0]
}

type serviceFixture struct {
	svc     *Service
	reg     *Registry
	revoker *fakeRevoker
	sar     *fakeSAR
	audit   *strings.Builder
}

// newService returns a service for caller over a registry holding, on
// spoke1, A1 of user A and B1 of user B, and on spoke2, A2 of user A.
func newService(t *testing.T, caller fakeAuthn, rules ...string) *serviceFixture {
	t.Helper()
	reg, rev, clk := newRegistry(t)
	ctx := context.Background()
	reg.Hello(ctx, spoke1, []*pb.Grant{grantOf("JTI=a1", userA, spoke1), grantOf("JTI=b1", userB, spoke1)})
	reg.Hello(ctx, spoke2, []*pb.Grant{grantOf("JTI=a2", userA, spoke2)})
	sar := &fakeSAR{rules: map[string]bool{}}
	for _, r := range rules {
		sar.rules[r] = true
	}
	f := &serviceFixture{reg: reg, revoker: rev, sar: sar, audit: &strings.Builder{}}
	var mu sync.Mutex
	svc, err := NewService(ServiceConfig{
		Authenticator: caller,
		AccessReviews: sar,
		Grants:        reg,
		Clock:         clk,
		Audit: funcr.New(func(prefix, args string) {
			mu.Lock()
			defer mu.Unlock()
			f.audit.WriteString(args + "\n")
		}, funcr.Options{}),
	})
	require.NoError(t, err)
	f.svc = svc
	return f
}

func live(reg *Registry) []string { return ids(reg.Select(Selector{})) }

// The attack: consumer B revokes consumer A's grant by its credential id,
// without any hub RBAC on A's ClusterProfile. It must be refused, and
// nothing revoked.
func TestRevokeOthersGrantWithoutRBACIsRefused(t *testing.T) {
	f := newService(t, fakeAuthn{user: userB})
	_, err := f.svc.Revoke(context.Background(), &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=a1"}})
	require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)
	assert.Contains(t, status.Convert(err).Message(), "delete clusterprofiles.multicluster.x-k8s.io/token on the ClusterProfile of the grant it names")
	assert.NotContains(t, status.Convert(err).Message(), "spoke-1", "the answer tells where another's grant lives")
	assert.Empty(t, f.revoker.calls, "no revoke may reach an agent")
	assert.ElementsMatch(t, []string{"JTI=a1", "JTI=b1", "JTI=a2"}, live(f.reg))
	assert.False(t, f.reg.Revoked("JTI=a1"))
}

func TestRevokeAuthorization(t *testing.T) {
	for _, tc := range []struct {
		name        string
		caller      hubauth.User
		rules       []string
		selector    *pb.GrantSelector
		wantCode    codes.Code
		wantRevoked []string
		wantReviews int
	}{
		{
			name: "own grant needs no RBAC", caller: userA,
			selector: &pb.GrantSelector{CredentialId: "JTI=a1"}, wantRevoked: []string{"JTI=a1"},
		},
		{
			name: "all own grants by username need no RBAC", caller: userA,
			selector: &pb.GrantSelector{Username: userA.Username}, wantRevoked: []string{"JTI=a1", "JTI=a2"},
		},
		{
			name: "another's grant with delete", caller: userB, rules: []string{"delete fleet/spoke-1"},
			selector: &pb.GrantSelector{CredentialId: "JTI=a1"}, wantRevoked: []string{"JTI=a1"}, wantReviews: 1,
		},
		{
			name: "another's grant with list only", caller: userB, rules: []string{"list fleet/spoke-1", "create fleet/spoke-1"},
			selector: &pb.GrantSelector{CredentialId: "JTI=a1"}, wantCode: codes.PermissionDenied, wantReviews: 1,
		},
		{
			name: "delete on another ClusterProfile does not count", caller: userB, rules: []string{"delete fleet/spoke-2"},
			selector: &pb.GrantSelector{CredentialId: "JTI=a1"}, wantCode: codes.PermissionDenied, wantReviews: 1,
		},
		{
			name: "same username, other UID is not the owner", caller: userARecreated,
			selector: &pb.GrantSelector{CredentialId: "JTI=a1"}, wantCode: codes.PermissionDenied, wantReviews: 1,
		},
		{
			name: "a user without a UID owns nothing", caller: hubauth.User{Username: userA.Username},
			selector: &pb.GrantSelector{CredentialId: "JTI=a1"}, wantCode: codes.PermissionDenied, wantReviews: 1,
		},
		{
			name: "a cluster with another's grant: all or nothing", caller: userB,
			selector: &pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "spoke-1"}},
			wantCode: codes.PermissionDenied, wantReviews: 1,
		},
		// A selector that names no ClusterProfile needs delete in every
		// namespace for others' grants: one review, whatever they hold.
		{
			name: "allowed on one ClusterProfile of two: nothing", caller: userB, rules: []string{"delete fleet/spoke-1"},
			selector: &pb.GrantSelector{Username: userA.Username}, wantCode: codes.PermissionDenied, wantReviews: 1,
		},
		{
			name: "allowed on each ClusterProfile is not allowed everywhere", caller: userB, rules: []string{"delete fleet/spoke-1", "delete fleet/spoke-2"},
			selector: &pb.GrantSelector{Username: userA.Username}, wantCode: codes.PermissionDenied, wantReviews: 1,
		},
		{
			name: "allowed everywhere", caller: userB, rules: []string{"delete /"},
			selector: &pb.GrantSelector{Username: userA.Username}, wantRevoked: []string{"JTI=a1", "JTI=a2"}, wantReviews: 1,
		},
		{
			name: "one review per ClusterProfile", caller: userARecreated, rules: []string{"delete fleet/spoke-1"},
			selector:    &pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "spoke-1"}},
			wantRevoked: []string{"JTI=a1", "JTI=b1"}, wantReviews: 1,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newService(t, fakeAuthn{user: tc.caller}, tc.rules...)
			resp, err := f.svc.Revoke(context.Background(), &pb.RevokeGrantsRequest{Selector: tc.selector, Reason: "test"})
			require.Equal(t, tc.wantCode, status.Code(err), "%v", err)
			assert.Len(t, f.sar.reviews, tc.wantReviews)
			if tc.wantCode != codes.OK {
				assert.Empty(t, f.revoker.calls, "nothing may be revoked")
				assert.Len(t, live(f.reg), 3)
				return
			}
			assert.ElementsMatch(t, tc.wantRevoked, ids(resp.GetRevoked()))
			assert.Empty(t, resp.GetPending())
			for _, id := range tc.wantRevoked {
				assert.True(t, f.reg.Revoked(id), id)
			}
		})
	}
}

func TestListAuthorization(t *testing.T) {
	for _, tc := range []struct {
		name        string
		caller      hubauth.User
		rules       []string
		selector    *pb.GrantSelector
		want        []string
		wantReviews int
	}{
		// An empty selector costs one review, of list in every
		// namespace, whatever others hold; without it, the caller sees
		// its own grants.
		{name: "own grants only", caller: userA, want: []string{"JTI=a1", "JTI=a2"}, wantReviews: 1},
		{name: "another's with list on its ClusterProfile", caller: userB, rules: []string{"list fleet/spoke-1"},
			selector: &pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "spoke-1"}}, want: []string{"JTI=a1", "JTI=b1"}, wantReviews: 1},
		{name: "list on one ClusterProfile does not list all", caller: userB, rules: []string{"list fleet/spoke-1"}, want: []string{"JTI=b1"}, wantReviews: 1},
		{name: "without list on the named ClusterProfile, own grants", caller: userB, rules: []string{"list fleet/spoke-2"},
			selector: &pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "spoke-1"}}, want: []string{"JTI=b1"}, wantReviews: 1},
		{name: "delete is not list", caller: userB, rules: []string{"delete /"}, want: []string{"JTI=b1"}, wantReviews: 1},
		{name: "same username, other UID sees nothing", caller: userARecreated, want: nil, wantReviews: 1},
		{name: "list on each ClusterProfile is not list everywhere", caller: userARecreated, rules: []string{"list fleet/spoke-1", "list fleet/spoke-2"},
			want: nil, wantReviews: 1},
		{name: "list everywhere", caller: userARecreated, rules: []string{"list /"}, want: []string{"JTI=a1", "JTI=b1", "JTI=a2"}, wantReviews: 1},
		{name: "another's by username with list everywhere", caller: userB, rules: []string{"list /"},
			selector: &pb.GrantSelector{Username: userA.Username}, want: []string{"JTI=a1", "JTI=a2"}, wantReviews: 1},
		{name: "own grants need no review", caller: userA, selector: &pb.GrantSelector{Username: userA.Username},
			want: []string{"JTI=a1", "JTI=a2"}, wantReviews: 0},
		{name: "selector by credential id", caller: userB, rules: []string{"list fleet/spoke-2"},
			selector: &pb.GrantSelector{CredentialId: "JTI=a2"}, want: []string{"JTI=a2"}, wantReviews: 1},
		{name: "own credential id needs no review", caller: userB,
			selector: &pb.GrantSelector{CredentialId: "JTI=b1"}, want: []string{"JTI=b1"}, wantReviews: 0},
		{name: "a credential id nobody holds costs a review too", caller: userB,
			selector: &pb.GrantSelector{CredentialId: "JTI=nope"}, want: nil, wantReviews: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newService(t, fakeAuthn{user: tc.caller}, tc.rules...)
			resp, err := f.svc.List(context.Background(), &pb.ListGrantsRequest{Selector: tc.selector})
			require.NoError(t, err)
			assert.ElementsMatch(t, tc.want, ids(resp.GetGrants()))
			assert.Len(t, f.sar.reviews, tc.wantReviews)
		})
	}
}

// The review asks about the grant's ClusterProfile, with everything the
// hub said of the caller.
func TestAccessReviewShape(t *testing.T) {
	f := newService(t, fakeAuthn{user: userA})
	_, err := f.svc.List(context.Background(), &pb.ListGrantsRequest{})
	require.NoError(t, err)
	require.Len(t, f.sar.reviews, 1)
	spec := f.sar.reviews[0].Spec
	assert.Equal(t, userA.Username, spec.User)
	assert.Equal(t, userA.UID, spec.UID)
	assert.Equal(t, userA.Groups, spec.Groups)
	assert.Equal(t, map[string]authorizationv1.ExtraValue{"authentication.kubernetes.io/pod-name": {"app-0"}}, spec.Extra)
	// An empty selector asks about every namespace.
	assert.Equal(t, &authorizationv1.ResourceAttributes{
		Group: "multicluster.x-k8s.io", Resource: "clusterprofiles", Subresource: "token", Verb: "list",
	}, spec.ResourceAttributes)

	f = newService(t, fakeAuthn{user: userB})
	_, err = f.svc.List(context.Background(), &pb.ListGrantsRequest{Selector: &pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "spoke-1"}}})
	require.NoError(t, err)
	require.Len(t, f.sar.reviews, 1)
	assert.Equal(t, &authorizationv1.ResourceAttributes{
		Group: "multicluster.x-k8s.io", Resource: "clusterprofiles", Subresource: "token",
		Verb: "list", Namespace: "fleet", Name: "spoke-1",
	}, f.sar.reviews[0].Spec.ResourceAttributes)
}

func TestRevokeRequests(t *testing.T) {
	for _, tc := range []struct {
		name     string
		authn    fakeAuthn
		rules    []string
		sarErr   error
		req      *pb.RevokeGrantsRequest
		wantCode codes.Code
		wantMsg  string
	}{
		{name: "no selector", req: &pb.RevokeGrantsRequest{}, wantCode: codes.InvalidArgument, wantMsg: "must select grants"},
		{name: "empty selector", req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{}}, wantCode: codes.InvalidArgument},
		{name: "nothing matches", rules: []string{"delete /"}, req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=nope"}},
			wantCode: codes.NotFound, wantMsg: "no live grant matches credential id JTI=nope; list"},
		// A caller that may revoke only its own grants is told the same
		// whether others' grants match or nothing does.
		{name: "nothing matches, without delete", req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=nope"}},
			wantCode: codes.PermissionDenied, wantMsg: "you may revoke only your own grants, and credential id JTI=nope matches others' grants or none of yours"},
		{name: "credential id without JTI=", req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "a1"}},
			wantCode: codes.InvalidArgument, wantMsg: "JTI=<jti>"},
		{name: "credential id with spaces", req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=a 1"}},
			wantCode: codes.InvalidArgument},
		{name: "bare JTI=", req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI="}}, wantCode: codes.InvalidArgument},
		{name: "cluster without name", req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "fleet"}}},
			wantCode: codes.InvalidArgument, wantMsg: "both a namespace and a name"},
		{name: "cluster not DNS", req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "Fleet", Name: "a"}}},
			wantCode: codes.InvalidArgument, wantMsg: "RFC 1123"},
		{name: "username with control characters", req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{Username: "a\nb"}},
			wantCode: codes.InvalidArgument},
		{name: "reason too long", req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=a1"}, Reason: strings.Repeat("r", 257)},
			wantCode: codes.InvalidArgument},
		{name: "unauthenticated", authn: fakeAuthn{err: errdefs.ErrUnauthenticated},
			req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=a1"}}, wantCode: codes.Unauthenticated},
		{name: "hub down fails closed", authn: fakeAuthn{user: userB}, sarErr: errors.New("dial tcp 10.0.0.1:6443: refused"),
			req: &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=a1"}}, wantCode: codes.Unavailable, wantMsg: "did not answer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			authn := tc.authn
			if authn.user.Username == "" && authn.err == nil {
				authn.user = userA
			}
			f := newService(t, authn, tc.rules...)
			f.sar.err = tc.sarErr
			_, err := f.svc.Revoke(context.Background(), tc.req)
			require.Equal(t, tc.wantCode, status.Code(err), "%v", err)
			assert.Contains(t, status.Convert(err).Message(), tc.wantMsg)
			assert.NotContains(t, status.Convert(err).Message(), "10.0.0.1")
			assert.Empty(t, f.revoker.calls)
		})
	}
}

func TestListFailsClosedWhenTheHubIsDown(t *testing.T) {
	f := newService(t, fakeAuthn{user: userB})
	f.sar.err = errors.New("connection refused")
	_, err := f.svc.List(context.Background(), &pb.ListGrantsRequest{})
	require.Equal(t, codes.Unavailable, status.Code(err))
}

func TestRevokeReportsPending(t *testing.T) {
	f := newService(t, fakeAuthn{user: userA})
	f.revoker.offline[types.NamespacedName{Namespace: "fleet", Name: "spoke-2"}] = true
	resp, err := f.svc.Revoke(context.Background(), &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{Username: userA.Username}})
	require.NoError(t, err)
	assert.Equal(t, []string{"JTI=a1"}, ids(resp.GetRevoked()))
	assert.Equal(t, []string{"JTI=a2"}, ids(resp.GetPending()))
}

// One audit line per call, naming the caller, the selector, the reason and
// the credential ids; a token pasted into a field appears only as its
// fingerprint.
func TestAuditLine(t *testing.T) {
	f := newService(t, fakeAuthn{user: userA})
	_, err := f.svc.Revoke(context.Background(), &pb.RevokeGrantsRequest{
		Selector: &pb.GrantSelector{Username: userA.Username}, Reason: "offboarded"})
	require.NoError(t, err)
	jwt := "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl"
	_, err = f.svc.List(context.Background(), &pb.ListGrantsRequest{Selector: &pb.GrantSelector{Username: jwt}})
	require.NoError(t, err)

	lines := strings.Split(strings.TrimSpace(f.audit.String()), "\n")
	require.Len(t, lines, 2)
	for _, want := range []string{`"method"="revoke"`, `"user"="system:serviceaccount:team-a:app"`, `"uid"="uid-a"`,
		`"selectorUsername"="system:serviceaccount:team-a:app"`, `"revokeReason"="offboarded"`,
		`"revoked"=["JTI=a1" "JTI=a2"]`, `"pending"=[]`, `"code"="OK"`} {
		assert.Contains(t, lines[0], want)
	}
	assert.Contains(t, lines[1], `"method"="list"`)
	assert.NotContains(t, f.audit.String(), jwt)
}

// manyClusters is the fixture of newService, with a grant of user B on
// each of n more ClusterProfiles.
func manyClusters(t *testing.T, caller hubauth.User, n int, rules ...string) *serviceFixture {
	t.Helper()
	f := newService(t, fakeAuthn{user: caller}, rules...)
	for i := range n {
		c := fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: "fleet", Name: fmt.Sprintf("many-%d", i)}, UID: types.UID(fmt.Sprint(i))}
		require.NoError(t, f.reg.Hello(context.Background(), c, []*pb.Grant{grantOf(fmt.Sprintf("JTI=m%d", i), userB, c)}))
	}
	return f
}

// The attack: a hub identity without any RBAC calls List and Revoke over
// and over while others hold grants on many ClusterProfiles. Its calls
// cost at most one hub review each, whatever others hold, and the hub's
// answer is cached: ten calls cost one review.
func TestCallsCostTheCallersOwn(t *testing.T) {
	for _, tc := range []struct {
		name string
		call func(*serviceFixture) error
	}{
		{"list, empty selector", func(f *serviceFixture) error {
			resp, err := f.svc.List(context.Background(), &pb.ListGrantsRequest{})
			if err == nil && len(resp.GetGrants()) != 2 {
				err = fmt.Errorf("listed %v, want the caller's two grants", ids(resp.GetGrants()))
			}
			return err
		}},
		{"list, another's username", func(f *serviceFixture) error {
			resp, err := f.svc.List(context.Background(), &pb.ListGrantsRequest{Selector: &pb.GrantSelector{Username: userB.Username}})
			if err == nil && len(resp.GetGrants()) != 0 {
				err = fmt.Errorf("listed %v, want none", ids(resp.GetGrants()))
			}
			return err
		}},
		{"revoke, another's username", func(f *serviceFixture) error {
			_, err := f.svc.Revoke(context.Background(), &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{Username: userB.Username}})
			if status.Code(err) == codes.PermissionDenied {
				return nil
			}
			return fmt.Errorf("revoke answered %v, want PermissionDenied", err)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := manyClusters(t, userA, 9)
			for range 10 {
				require.NoError(t, tc.call(f))
			}
			assert.Len(t, f.sar.reviews, 1, "ten calls by a caller without RBAC, others' grants on 10 ClusterProfiles")
			assert.Empty(t, f.revoker.calls)
		})
	}
}

// The hub's answers are kept for AllowTTL or DenyTTL, then asked again;
// they are kept per caller, verb and scope.
func TestReviewsAreCachedBriefly(t *testing.T) {
	f := manyClusters(t, userA, 1)
	clk := f.svc.cfg.Clock.(*clocktesting.FakePassiveClock)
	list := func(sel *pb.GrantSelector) {
		_, err := f.svc.List(context.Background(), &pb.ListGrantsRequest{Selector: sel})
		require.NoError(t, err)
	}
	list(nil)
	list(nil)
	require.Len(t, f.sar.reviews, 1)
	list(&pb.GrantSelector{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "spoke-1"}})
	require.Len(t, f.sar.reviews, 2, "another scope is another review")
	_, err := f.svc.Revoke(context.Background(), &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{Username: userB.Username}})
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	require.Len(t, f.sar.reviews, 3, "another verb is another review")
	clk.SetTime(clk.Now().Add(2*time.Second - time.Nanosecond))
	list(nil)
	require.Len(t, f.sar.reviews, 3, "a denial is kept for DenyTTL")
	clk.SetTime(clk.Now().Add(time.Nanosecond))
	list(nil)
	require.Len(t, f.sar.reviews, 4, "a denial is asked again after DenyTTL")

	f.sar.mu.Lock()
	f.sar.rules["list /"] = true
	f.sar.mu.Unlock()
	clk.SetTime(clk.Now().Add(2 * time.Second))
	list(nil)
	require.Len(t, f.sar.reviews, 5)
	clk.SetTime(clk.Now().Add(10*time.Second - time.Nanosecond))
	list(nil)
	require.Len(t, f.sar.reviews, 5, "an approval is kept for AllowTTL")
	clk.SetTime(clk.Now().Add(time.Nanosecond))
	list(nil)
	require.Len(t, f.sar.reviews, 6, "an approval is asked again after AllowTTL")
}

// A caller without delete gets the same answer whether the grant it names
// exists, as another's, or not at all.
func TestRevokeAnswerDoesNotTellExistence(t *testing.T) {
	f := newService(t, fakeAuthn{user: userB})
	_, exists := f.svc.Revoke(context.Background(), &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=a1"}})
	_, absent := f.svc.Revoke(context.Background(), &pb.RevokeGrantsRequest{Selector: &pb.GrantSelector{CredentialId: "JTI=zz"}})
	require.Equal(t, codes.PermissionDenied, status.Code(exists))
	require.Equal(t, codes.PermissionDenied, status.Code(absent))
	// Only the id the caller sent differs. (Round 2 found the scope's
	// words told the two apart: "of the grant's ClusterProfile" against
	// "in every namespace".)
	norm := func(err error) string {
		m := status.Convert(err).Message()
		m = strings.ReplaceAll(m, "JTI=a1", "JTI=?")
		return strings.ReplaceAll(m, "JTI=zz", "JTI=?")
	}
	assert.Equal(t, norm(exists), norm(absent))
	assert.Len(t, f.sar.reviews, 2)
}
