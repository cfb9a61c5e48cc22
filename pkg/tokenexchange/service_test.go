package tokenexchange

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
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

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func jwt(claims string) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256"}`)) + "." + enc([]byte(claims)) + "." + enc([]byte("sig"))
}

// hubConsumer tells the fake hub which tokens to accept: those whose sub
// claim is "consumer" or "second-consumer", two ServiceAccounts of namespace
// hub. It returns the sub, or "" for a token the hub rejects.
func hubConsumer(tok string) string {
	parts := strings.Split(tok, ".")
	if len(parts) != 3 {
		return ""
	}
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	var claims struct {
		Sub string `json:"sub"`
	}
	if err != nil || json.Unmarshal(raw, &claims) != nil || (claims.Sub != "consumer" && claims.Sub != "second-consumer") {
		return ""
	}
	return claims.Sub
}

// consumerToken expires an hour after t0.
var consumerToken = consumerTokenExpiring(t0.Add(time.Hour))

func consumerTokenExpiring(exp time.Time) string {
	return jwt(fmt.Sprintf(`{"sub":"consumer","exp":%d}`, exp.Unix()))
}

// fakeReviews answers TokenReviews and SubjectAccessReviews like a hub on
// which consumer tokens belong to hub:consumer (and second-consumer tokens
// to hub:second-consumer), who may use ClusterProfile fleet/a only.
type fakeReviews struct {
	tokenReviews, accessReviews atomic.Int32
	down, hang                  atomic.Bool
	// recreated counts how often the consumers' ServiceAccounts were deleted
	// and recreated: each time gives them a new uid.
	recreated atomic.Int32
	mu        sync.Mutex
	sars      []authorizationv1.SubjectAccessReviewSpec // every SubjectAccessReview asked, in order
	// audiences, when set, replaces the audiences an authenticated review
	// reports: an authenticator that ignores the requested audiences.
	audiences func(requested []string) []string
}

func (f *fakeReviews) Create(ctx context.Context, tr *authenticationv1.TokenReview, _ metav1.CreateOptions) (*authenticationv1.TokenReview, error) {
	f.tokenReviews.Add(1)
	if f.hang.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if f.down.Load() {
		return nil, errors.New("connection refused")
	}
	out := tr.DeepCopy()
	sub := hubConsumer(tr.Spec.Token)
	uid := sub + "-uid"
	if n := f.recreated.Load(); n > 0 {
		uid = fmt.Sprintf("%s-%d", uid, n)
	}
	if sub == "" || len(tr.Spec.Audiences) != 1 || tr.Spec.Audiences[0] != "credbroker" {
		out.Status = authenticationv1.TokenReviewStatus{Error: "invalid bearer token"}
		return out, nil
	}
	audiences := tr.Spec.Audiences
	if f.audiences != nil {
		audiences = f.audiences(audiences)
	}
	out.Status = authenticationv1.TokenReviewStatus{
		Authenticated: true,
		Audiences:     audiences,
		User: authenticationv1.UserInfo{
			Username: "system:serviceaccount:hub:" + sub, UID: uid,
			Groups: []string{"system:serviceaccounts"},
			Extra:  map[string]authenticationv1.ExtraValue{"authentication.kubernetes.io/pod-name": {"consumer-0"}},
		},
	}
	return out, nil
}

type fakeAccessReviews struct{ *fakeReviews }

func (f fakeAccessReviews) Create(_ context.Context, sar *authorizationv1.SubjectAccessReview, _ metav1.CreateOptions) (*authorizationv1.SubjectAccessReview, error) {
	f.accessReviews.Add(1)
	f.mu.Lock()
	f.sars = append(f.sars, *sar.Spec.DeepCopy())
	f.mu.Unlock()
	if f.down.Load() {
		return nil, errors.New("connection refused")
	}
	out := sar.DeepCopy()
	ra := sar.Spec.ResourceAttributes
	out.Status.Allowed = (sar.Spec.User == "system:serviceaccount:hub:consumer" || sar.Spec.User == "system:serviceaccount:hub:second-consumer") &&
		ra.Group == hubauth.Group && ra.Resource == hubauth.Resource && ra.Subresource == hubauth.Subresource && ra.Verb == hubauth.VerbCreate &&
		ra.Namespace == "fleet" && ra.Name == "a"
	return out, nil
}

type fakeClusters struct {
	mu  sync.Mutex
	uid types.UID
}

func (f *fakeClusters) Cluster(namespace, name string) (fleet.Cluster, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if namespace != "fleet" || (name != "a" && name != "b") {
		return fleet.Cluster{}, fmt.Errorf("clusterprofile %s/%s not found: %w", namespace, name, errdefs.ErrNotFound)
	}
	return fleet.Cluster{
		Ref:    fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: namespace, Name: name}, UID: f.uid},
		Server: "https://spoke.example", CAData: []byte("ca"),
	}, nil
}

// fakeMinter mints a distinct token per call, like an honest agent: for the
// requested ServiceAccount (spoke/reader when none is named) and audiences
// (the spoke's default when none are), valid for the requested time.
type fakeMinter struct {
	clock *clocktesting.FakeClock
	calls atomic.Int32
	err   error
	gate  chan struct{} // when set, Mint waits for it
	// tamper, when set, changes the answer before it is returned.
	tamper func(*pb.MintResponse)
}

func (m *fakeMinter) Mint(ctx context.Context, _ fleet.ClusterRef, req *pb.MintRequest) (*pb.MintResponse, error) {
	n := m.calls.Add(1)
	if m.gate != nil {
		<-m.gate
	}
	if m.err != nil {
		return nil, m.err
	}
	sa := &pb.ObjectReference{Namespace: "spoke", Name: "reader"}
	if req.GetServiceAccount() != nil {
		sa = req.GetServiceAccount()
	}
	aud := req.GetAudiences()
	if len(aud) == 0 {
		aud = []string{"https://kubernetes.default.svc"}
	}
	exp := m.clock.Now().Add(time.Duration(req.GetExpirationSeconds()) * time.Second)
	resp := &pb.MintResponse{
		Token:          spokeToken("system:serviceaccount:"+sa.GetNamespace()+":"+sa.GetName(), aud, exp, fmt.Sprintf("minted-%d", n)),
		ExpirationTime: timestamppb.New(exp),
		ServiceAccount: sa,
	}
	if m.tamper != nil {
		m.tamper(resp)
	}
	return resp, nil
}

// spokeToken is shaped like a spoke ServiceAccount token with these claims.
func spokeToken(sub string, aud []string, exp time.Time, jti string) string {
	b, _ := json.Marshal(map[string]any{"iss": "https://spoke", "sub": sub, "aud": aud, "exp": exp.Unix(), "jti": jti})
	return jwt(string(b))
}

type fixture struct {
	svc     *Service
	clock   *clocktesting.FakeClock
	reviews *fakeReviews
	minter  *fakeMinter
	cluster *fakeClusters
	audit   *strings.Builder
	// verifier accepts every token unless told otherwise.
	verifier *fakeVerifier
}

func newFixture(t testing.TB, mutate ...func(*Config)) *fixture {
	t.Helper()
	f := &fixture{clock: clocktesting.NewFakeClock(t0), reviews: &fakeReviews{}, cluster: &fakeClusters{uid: "uid-1"}, audit: &strings.Builder{}}
	f.minter = &fakeMinter{clock: f.clock}
	var mu sync.Mutex
	f.verifier = &fakeVerifier{}
	cfg := Config{
		TokenReviews:  f.reviews,
		AccessReviews: fakeAccessReviews{f.reviews},
		Verifier:      f.verifier,
		Clusters:      f.cluster,
		Minter:        f.minter,
		Clock:         f.clock,
		Audit: funcr.New(func(prefix, args string) {
			mu.Lock()
			defer mu.Unlock()
			f.audit.WriteString(args + "\n")
		}, funcr.Options{}),
	}
	for _, m := range mutate {
		m(&cfg)
	}
	var err error
	f.svc, err = New(cfg)
	require.NoError(t, err)
	return f
}

func withBearer(tok string) context.Context {
	return metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer "+tok))
}

func fleetA() *pb.ExchangeRequest {
	return &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "a"}}
}

func TestExchange(t *testing.T) {
	f := newFixture(t)
	resp, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	assert.Equal(t, spokeToken("system:serviceaccount:spoke:reader", []string{"https://kubernetes.default.svc"}, t0.Add(time.Hour), "minted-1"), resp.GetToken())
	assert.Equal(t, t0.Add(time.Hour), resp.GetExpirationTime().AsTime(), "zero expiration means the maximum")
	assert.Equal(t, "https://spoke.example", resp.GetServer())
	assert.Equal(t, []byte("ca"), resp.GetCertificateAuthorityData())
	assert.Equal(t, "JTI=minted-1", resp.GetCredentialId())
	assert.Equal(t, "reader", resp.GetServiceAccount().GetName())

	line := f.audit.String()
	for _, want := range []string{`"user"="system:serviceaccount:hub:consumer"`, `"uid"="consumer-uid"`, `"cluster"="fleet/a"`,
		`"code"="OK"`, `"cacheHit"=false`, `"credentialID"="JTI=minted-1"`, `"serviceAccount"="spoke/reader"`, `"expiration"="2026-01-01T01:00:00Z"`,
		`"tokenAudiences"=["https://kubernetes.default.svc"]`} {
		assert.Contains(t, line, want)
	}
	assert.NotContains(t, line, resp.GetToken())
	assert.NotContains(t, line, consumerToken)
}

func TestExchangeErrors(t *testing.T) {
	tests := []struct {
		name     string
		ctx      context.Context
		req      *pb.ExchangeRequest
		setup    func(*fixture)
		wantCode codes.Code
		wantMsg  string
	}{
		{
			name: "no authorization header", ctx: context.Background(), req: fleetA(),
			wantCode: codes.Unauthenticated,
			wantMsg:  "send one 'authorization: Bearer <hub ServiceAccount token>' header, got 0: unauthenticated",
		},
		{
			name: "basic auth", req: fleetA(),
			ctx:      metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Basic dXNlcjpwYXNz")),
			wantCode: codes.Unauthenticated,
			wantMsg:  "the authorization header must use the Bearer scheme: unauthenticated",
		},
		{
			name: "not a jwt", ctx: withBearer("opaque-token"), req: fleetA(),
			wantCode: codes.Unauthenticated,
			wantMsg:  "bearer token is not a JWT: 1 segments, want 3: unauthenticated",
		},
		{
			name: "token the hub rejects", ctx: withBearer(jwt(`{"sub":"x"}`)), req: fleetA(),
			wantCode: codes.Unauthenticated,
			wantMsg:  `the hub rejected the token for audience "credbroker": invalid bearer token: unauthenticated`,
		},
		{
			name: "no RBAC for the cluster", ctx: withBearer(consumerToken),
			req:      &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "b"}},
			wantCode: codes.PermissionDenied,
			wantMsg:  `hub RBAC does not allow "system:serviceaccount:hub:consumer" to create clusterprofiles.multicluster.x-k8s.io/token "b" in namespace "fleet": permission denied`,
		},
		{
			name: "missing cluster", ctx: withBearer(consumerToken), req: &pb.ExchangeRequest{},
			wantCode: codes.InvalidArgument,
			wantMsg:  "cluster is required: invalid argument",
		},
		{
			name: "bad cluster name", ctx: withBearer(consumerToken),
			req:      &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "A_B"}},
			wantCode: codes.InvalidArgument,
			wantMsg:  `cluster.name "A_B": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*'): invalid argument`,
		},
		{
			name: "negative expiration", ctx: withBearer(consumerToken),
			req:      &pb.ExchangeRequest{Cluster: fleetA().Cluster, ExpirationSeconds: -5},
			wantCode: codes.InvalidArgument,
			wantMsg:  "expiration_seconds: -5 is negative; send 0 for the maximum (1h0m0s): invalid argument",
		},
		{
			name: "empty audience", ctx: withBearer(consumerToken),
			req:      &pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"a", ""}},
			wantCode: codes.InvalidArgument,
			wantMsg:  "audiences[1]: want 1 to 256 printable characters: invalid argument",
		},
		{
			name: "hub unreachable", ctx: withBearer(consumerToken), req: fleetA(),
			setup:    func(f *fixture) { f.reviews.down.Store(true) },
			wantCode: codes.Unavailable,
			wantMsg:  "hub TokenReview failed: the hub API server did not answer: unavailable",
		},
		{
			name: "agent refuses", ctx: withBearer(consumerToken), req: fleetA(),
			setup: func(f *fixture) {
				f.minter.err = errdefs.FromCode(codes.PermissionDenied, "agent: no spoke ServiceAccount allows the consumer")
			},
			wantCode: codes.PermissionDenied,
			wantMsg:  "agent: no spoke ServiceAccount allows the consumer",
		},
		{
			name: "internal error hides detail", ctx: withBearer(consumerToken), req: fleetA(),
			setup:    func(f *fixture) { f.minter.err = errors.New("secret detail") },
			wantCode: codes.Internal,
			wantMsg:  errdefs.InternalMessage,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t)
			if tt.setup != nil {
				tt.setup(f)
			}
			_, err := f.svc.Exchange(tt.ctx, tt.req)
			st := status.Convert(err)
			assert.Equal(t, tt.wantCode, st.Code())
			assert.Equal(t, tt.wantMsg, st.Message())
			assert.Contains(t, f.audit.String(), `"code"="`+tt.wantCode.String()+`"`)
		})
	}
}

// The consumer's plugin checks that the token goes to the cluster's server,
// so an answer never lacks one: a cluster without a server is refused
// before anything is minted.
func TestMintedTokenIsReusedWhileHalfItsLifetimeRemains(t *testing.T) {
	f := newFixture(t)
	req := &pb.ExchangeRequest{Cluster: fleetA().Cluster, ExpirationSeconds: 1200}
	first, err := f.svc.Exchange(withBearer(consumerToken), req)
	require.NoError(t, err)

	f.clock.Step(599 * time.Second)
	again, err := f.svc.Exchange(withBearer(consumerToken), req)
	require.NoError(t, err)
	assert.Equal(t, first.GetToken(), again.GetToken())
	assert.Contains(t, f.audit.String(), `"cacheHit"=true`)

	f.clock.Step(time.Second) // half of 1200s has passed
	fresh, err := f.svc.Exchange(withBearer(consumerToken), req)
	require.NoError(t, err)
	assert.NotEqual(t, first.GetToken(), fresh.GetToken())
	assert.Equal(t, int32(2), f.minter.calls.Load())
}

func TestTokenCacheKey(t *testing.T) {
	f := newFixture(t)
	exchange := func(req *pb.ExchangeRequest) string {
		resp, err := f.svc.Exchange(withBearer(consumerToken), req)
		require.NoError(t, err)
		return resp.GetToken()
	}
	base := exchange(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"x", "y"}})
	assert.Equal(t, base, exchange(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"y", "x", "x"}}), "audiences are a set")
	assert.NotEqual(t, base, exchange(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"x"}}))
	assert.NotEqual(t, base, exchange(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"x", "y"},
		ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "reader"}}))

	f.cluster.mu.Lock()
	f.cluster.uid = "uid-2" // the ClusterProfile was deleted and recreated
	f.cluster.mu.Unlock()
	assert.NotEqual(t, base, exchange(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: []string{"x", "y"}}))
}

// Attack: a second consumer asks for the same cluster, ServiceAccount and
// audiences as the first, within the first one's token lifetime. With the
// consumer out of the cache key it is handed the first consumer's token:
// the spoke's grant, audit and revocation then name the wrong consumer, and
// revoking one consumer leaves the other holding the token.
// Defence: the token cache key holds the consumer's username and uid.
func TestTokenCacheIsPerConsumer(t *testing.T) {
	f := newFixture(t)
	second := jwt(fmt.Sprintf(`{"sub":"second-consumer","exp":%d}`, t0.Add(time.Hour).Unix()))
	req := func() *pb.ExchangeRequest {
		return &pb.ExchangeRequest{Cluster: fleetA().Cluster, ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "shared"}}
	}
	first, err := f.svc.Exchange(withBearer(consumerToken), req())
	require.NoError(t, err)
	other, err := f.svc.Exchange(withBearer(second), req())
	require.NoError(t, err)
	assert.NotEqual(t, first.GetToken(), other.GetToken(), "the second consumer got the first one's token")
	assert.NotEqual(t, first.GetCredentialId(), other.GetCredentialId())
	assert.Equal(t, int32(2), f.minter.calls.Load(), "one mint per consumer")

	// Each consumer still reuses its own.
	again, err := f.svc.Exchange(withBearer(second), req())
	require.NoError(t, err)
	assert.Equal(t, other.GetToken(), again.GetToken())
	assert.Equal(t, int32(2), f.minter.calls.Load())

	// The first consumer's ServiceAccount is deleted and recreated under the
	// same name: the new one is another consumer.
	f.reviews.recreated.Add(1)
	recreated, err := f.svc.Exchange(withBearer(consumerTokenExpiring(t0.Add(2*time.Hour))), req())
	require.NoError(t, err)
	assert.NotEqual(t, first.GetToken(), recreated.GetToken(), "a recreated ServiceAccount got its predecessor's token")
	assert.Equal(t, int32(3), f.minter.calls.Load())
}

func TestConcurrentMissesMintOnce(t *testing.T) {
	f := newFixture(t)
	f.minter.gate = make(chan struct{})
	const callers = 8
	var wg sync.WaitGroup
	tokens := make([]string, callers)
	for i := range callers {
		wg.Go(func() {
			resp, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
			assert.NoError(t, err)
			tokens[i] = resp.GetToken()
		})
	}
	require.Eventually(t, func() bool { return f.minter.calls.Load() == 1 }, 10*time.Second, time.Millisecond)
	close(f.minter.gate)
	wg.Wait()
	for _, tok := range tokens {
		assert.Equal(t, tokens[0], tok)
	}
	// Callers that joined the flight share its mint; later ones hit the cache.
	assert.Equal(t, int32(1), f.minter.calls.Load())
}

func TestDecisionCaching(t *testing.T) {
	f := newFixture(t)
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	assert.Equal(t, int32(1), f.reviews.tokenReviews.Load())
	assert.Equal(t, int32(1), f.reviews.accessReviews.Load())

	// The hub goes away: fresh decisions are still honoured, stale ones are
	// not (fail closed).
	f.reviews.down.Store(true)
	f.clock.Step(9 * time.Second)
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	f.clock.Step(time.Second)
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	assert.Equal(t, codes.Unavailable, status.Code(err))
}

func TestDenialsAreCachedForLessTime(t *testing.T) {
	f := newFixture(t)
	fleetB := &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "b"}}
	for range 2 {
		_, err := f.svc.Exchange(withBearer(consumerToken), fleetB)
		require.Equal(t, codes.PermissionDenied, status.Code(err))
	}
	assert.Equal(t, int32(1), f.reviews.accessReviews.Load())
	f.clock.Step(2 * time.Second)
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetB)
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	assert.Equal(t, int32(2), f.reviews.accessReviews.Load(), "the denial expired after DenyTTL")
}

func TestAuthnCacheNeverOutlivesTheToken(t *testing.T) {
	short := consumerTokenExpiring(t0.Add(3 * time.Second))
	f := newFixture(t)
	_, err := f.svc.Exchange(withBearer(short), fleetA())
	require.NoError(t, err)
	f.clock.Step(2 * time.Second)
	_, err = f.svc.Exchange(withBearer(short), fleetA())
	require.NoError(t, err)
	assert.Equal(t, int32(1), f.reviews.tokenReviews.Load())

	f.clock.Step(time.Second) // the token's exp, well before AuthnTTL
	_, err = f.svc.Exchange(withBearer(short), fleetA())
	require.NoError(t, err)
	assert.Equal(t, int32(2), f.reviews.tokenReviews.Load(), "the hub was asked again once the token expired")
}

func TestRejectionsAreCachedBriefly(t *testing.T) {
	f := newFixture(t)
	bad := jwt(`{"sub":"someone-else"}`)
	for range 2 {
		_, err := f.svc.Exchange(withBearer(bad), fleetA())
		require.Equal(t, codes.Unauthenticated, status.Code(err))
	}
	assert.Equal(t, int32(1), f.reviews.tokenReviews.Load())
	f.clock.Step(2 * time.Second)
	_, err := f.svc.Exchange(withBearer(bad), fleetA())
	require.Equal(t, codes.Unauthenticated, status.Code(err))
	assert.Equal(t, int32(2), f.reviews.tokenReviews.Load())
}

func TestHungHubIsUnavailable(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.ReviewTimeout = 50 * time.Millisecond })
	f.reviews.hang.Store(true)
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	assert.Equal(t, codes.Unavailable, status.Code(err))
	assert.Equal(t, "hub TokenReview failed: the hub API server did not answer in time: unavailable", status.Convert(err).Message())
}

func TestNewTokensAreReviewedAtABoundedRate(t *testing.T) {
	f := newFixture(t, func(c *Config) { c.ReviewRateLimit, c.ReviewBurst = 1, 2 })
	for i := range 2 {
		_, err := f.svc.Exchange(withBearer(jwt(fmt.Sprintf(`{"sub":"forged-%d"}`, i))), fleetA())
		require.Equal(t, codes.Unauthenticated, status.Code(err))
	}
	_, err := f.svc.Exchange(withBearer(jwt(`{"sub":"forged-3"}`)), fleetA())
	assert.Equal(t, codes.ResourceExhausted, status.Code(err))
	assert.Equal(t, int32(2), f.reviews.tokenReviews.Load())

	// A token already reviewed is still served from the cache.
	f.clock.Step(time.Second)
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	_, err = f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	assert.Equal(t, int32(3), f.reviews.tokenReviews.Load())
}

func TestNewValidates(t *testing.T) {
	_, err := New(Config{})
	assert.EqualError(t, err, "tokenexchange: TokenReviews, AccessReviews, Verifier, Clusters and Minter are required")
	f := &fakeReviews{}
	_, err = New(Config{TokenReviews: f, AccessReviews: fakeAccessReviews{f}, Clusters: &fakeClusters{}, Minter: &fakeMinter{}})
	assert.EqualError(t, err, "tokenexchange: TokenReviews, AccessReviews, Verifier, Clusters and Minter are required", "without a Verifier")
	_, err = New(Config{TokenReviews: f, AccessReviews: fakeAccessReviews{f}, Verifier: &fakeVerifier{}, Clusters: &fakeClusters{}, Minter: &fakeMinter{},
		MaxExpiration: 5 * time.Minute})
	assert.EqualError(t, err, "tokenexchange: want 10m <= MinExpiration (10m0s) <= MaxExpiration (5m0s)")
}
