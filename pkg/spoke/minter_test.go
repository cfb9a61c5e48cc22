package spoke

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants"
	credbrokerv1alpha1 "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

const (
	argocd = "system:serviceaccount:argocd:argocd-application-controller"
	flux   = "system:serviceaccount:flux-system:kustomize-controller"
)

// issuedAt is when fakeTokens mints every token.
var issuedAt = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// fakeToken is what fakeTokens returns for a ServiceAccount: a JWT whose jti
// names it.
func fakeToken(namespace, name string) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256"}`)) + "." +
		enc(fmt.Appendf(nil, `{"jti":"jti-%s-%s"}`, namespace, name)) + "." +
		enc([]byte("signature"))
}

type createCall struct {
	namespace, name string
	req             *authenticationv1.TokenRequest
}

// fakeTokens is a TokenCreator that records its calls and either fails with
// err or mints fakeToken, valid for the requested seconds from issuedAt.
type fakeTokens struct {
	err   error
	empty bool // return a TokenRequest without a token
	noExp bool // return a token without an expiration timestamp

	mu    sync.Mutex
	calls []createCall
}

func (f *fakeTokens) CreateToken(_ context.Context, namespace, name string, req *authenticationv1.TokenRequest) (*authenticationv1.TokenRequest, error) {
	f.mu.Lock()
	f.calls = append(f.calls, createCall{namespace: namespace, name: name, req: req.DeepCopy()})
	f.mu.Unlock()
	if f.err != nil {
		return nil, f.err
	}
	out := req.DeepCopy()
	if f.empty {
		return out, nil
	}
	out.Status = authenticationv1.TokenRequestStatus{
		Token:               fakeToken(namespace, name),
		ExpirationTimestamp: metav1.NewTime(issuedAt.Add(time.Duration(*req.Spec.ExpirationSeconds) * time.Second)),
	}
	if f.noExp {
		out.Status.ExpirationTimestamp = metav1.Time{}
	}
	return out, nil
}

func (f *fakeTokens) Calls() []createCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]createCall(nil), f.calls...)
}

func serviceAccount(namespace, name, allowed string) *corev1.ServiceAccount {
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{
		Namespace: namespace,
		Name:      name,
		UID:       types.UID("uid-" + namespace + "-" + name),
	}}
	if allowed != "" {
		sa.Annotations = map[string]string{AllowedSubjectsAnnotation: allowed}
	}
	return sa
}

// lister returns a ServiceAccountLister over an indexer holding sas, as an
// informer's would.
func lister(t *testing.T, sas ...*corev1.ServiceAccount) corev1listers.ServiceAccountLister {
	t.Helper()
	indexer := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	for _, sa := range sas {
		require.NoError(t, indexer.Add(sa))
	}
	return corev1listers.NewServiceAccountLister(indexer)
}

func newMinter(t *testing.T, tokens TokenCreator, sas ...*corev1.ServiceAccount) *Minter {
	t.Helper()
	m, err := New(withGrants(Config{Tokens: tokens, ServiceAccounts: lister(t, sas...)}, newFakeGrants()))
	require.NoError(t, err)
	return m
}

func ref(namespace, name string) *credbrokerv1alpha1.ObjectReference {
	return &credbrokerv1alpha1.ObjectReference{Namespace: namespace, Name: name}
}

func subject(username string) *credbrokerv1alpha1.Subject {
	return &credbrokerv1alpha1.Subject{Username: username, Uid: "hub-uid", Groups: []string{"system:serviceaccounts"}}
}

// requireRefused checks that Mint refused with wantErr, wrapping sentinel,
// and asked the TokenRequest API for nothing.
func requireRefused(t *testing.T, tokens *fakeTokens, resp *credbrokerv1alpha1.MintResponse, err error, wantErr string, sentinel error) {
	t.Helper()
	require.EqualError(t, err, wantErr)
	assert.ErrorIs(t, err, sentinel)
	assert.Nil(t, resp)
	assert.Empty(t, tokens.Calls(), "a refused request must not reach the TokenRequest API")
}

func TestNew(t *testing.T) {
	tokens := &fakeTokens{}
	grants := newFakeGrants()
	sas := lister(t)
	tests := []struct {
		name    string
		cfg     Config
		wantMin int64
		wantMax int64
		wantErr string
	}{
		{name: "defaults", cfg: Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache}, wantMin: 600, wantMax: 3600},
		{
			name:    "explicit bounds",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, MinExpiration: 15 * time.Minute, MaxExpiration: 2 * time.Hour},
			wantMin: 900, wantMax: 7200,
		},
		{
			name:    "min equals max",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, MinExpiration: 10 * time.Minute, MaxExpiration: 10 * time.Minute},
			wantMin: 600, wantMax: 600,
		},
		{
			name:    "longest max",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, MaxExpiration: (1 << 32) * time.Second},
			wantMin: 600, wantMax: 1 << 32,
		},
		{name: "no tokens", cfg: Config{ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache}, wantErr: "spoke config: Tokens is required"},
		{name: "no lister", cfg: Config{Tokens: tokens, Grants: grants, GrantCache: grants.cache}, wantErr: "spoke config: ServiceAccounts is required"},
		{name: "no grants", cfg: Config{Tokens: tokens, ServiceAccounts: sas}, wantErr: "spoke config: Grants is required"},
		{name: "no grant cache", cfg: Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants}, wantErr: "spoke config: GrantCache is required"},
		{
			name: "grant cache without the indexes",
			cfg: Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants,
				GrantCache: cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{GrantServiceAccountIndex: GrantIndexers()[GrantServiceAccountIndex]})},
			wantErr: `spoke config: GrantCache has no index "credbroker.io/credential-id"; build it with GrantIndexers`,
		},
		{
			name:    "negative collect interval",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, CollectInterval: -time.Second},
			wantErr: "spoke config: CollectInterval -1s is negative",
		},
		{
			name:    "min below TokenRequest floor",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, MinExpiration: 5 * time.Minute},
			wantErr: "spoke config: MinExpiration 5m0s is shorter than 10m0s, the TokenRequest API's minimum",
		},
		{
			name:    "negative min",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, MinExpiration: -time.Hour},
			wantErr: "spoke config: MinExpiration -1h0m0s is shorter than 10m0s, the TokenRequest API's minimum",
		},
		{
			name:    "max below default min",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, MaxExpiration: 5 * time.Minute},
			wantErr: "spoke config: MaxExpiration 5m0s is shorter than MinExpiration 10m0s",
		},
		{
			name:    "min above default max",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, MinExpiration: 2 * time.Hour},
			wantErr: "spoke config: MaxExpiration 1h0m0s is shorter than MinExpiration 2h0m0s",
		},
		{
			name:    "max above TokenRequest ceiling",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, MaxExpiration: (1<<32 + 1) * time.Second},
			wantErr: "spoke config: MaxExpiration 1193046h28m17s is longer than 1193046h28m16s, the TokenRequest API's maximum",
		},
		{
			name:    "fractional seconds",
			cfg:     Config{Tokens: tokens, ServiceAccounts: sas, Grants: grants, GrantCache: grants.cache, MaxExpiration: time.Hour + time.Millisecond},
			wantErr: "spoke config: MinExpiration 10m0s and MaxExpiration 1h0m0.001s must be whole seconds",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := New(tt.cfg)
			if tt.wantErr != "" {
				require.EqualError(t, err, tt.wantErr)
				assert.Nil(t, m)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.wantMin, m.minSeconds)
			assert.Equal(t, tt.wantMax, m.maxSeconds)
		})
	}
}

func TestMintPolicy(t *testing.T) {
	sas := []*corev1.ServiceAccount{
		serviceAccount("apps", "deployer", argocd),
		serviceAccount("apps", "reader", " "+flux+" , "+argocd+",,"),
		serviceAccount("apps", "closed", ""),
		serviceAccount("team-b", "builder", "alice"),
		serviceAccount("team-a", "builder", "bob, alice"),
		serviceAccount("team-c", "sync", flux),
		serviceAccount("ops", "lookalike", "ALICE, alice2, system:serviceaccount:argocd:*"),
	}
	tests := []struct {
		name     string
		req      *credbrokerv1alpha1.MintRequest
		wantSA   *credbrokerv1alpha1.ObjectReference
		wantErr  string
		wantCode error
	}{
		{
			name:   "named and allowed",
			req:    &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "deployer")},
			wantSA: ref("apps", "deployer"),
		},
		{
			name:   "named, allowed among several entries with spaces",
			req:    &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "reader")},
			wantSA: ref("apps", "reader"),
		},
		{
			name:     "named but missing",
			req:      &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "ghost")},
			wantErr:  "spoke ServiceAccount apps/ghost: not found",
			wantCode: errdefs.ErrNotFound,
		},
		{
			name:     "named but in a namespace the lister does not see",
			req:      &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("elsewhere", "deployer")},
			wantErr:  "spoke ServiceAccount elsewhere/deployer: not found",
			wantCode: errdefs.ErrNotFound,
		},
		{
			name:     "named but not annotated",
			req:      &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "closed")},
			wantErr:  "spoke ServiceAccount apps/closed does not allow hub user " + argocd + "; a spoke admin must add " + argocd + " to its credbroker.io/allowed-subjects annotation: permission denied",
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "named but annotated for someone else",
			req:      &credbrokerv1alpha1.MintRequest{Subject: subject(flux), ServiceAccount: ref("apps", "deployer")},
			wantErr:  "spoke ServiceAccount apps/deployer does not allow hub user " + flux + "; a spoke admin must add " + flux + " to its credbroker.io/allowed-subjects annotation: permission denied",
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "match is exact: no case folding, prefixes or wildcards",
			req:      &credbrokerv1alpha1.MintRequest{Subject: subject("alice"), ServiceAccount: ref("ops", "lookalike")},
			wantErr:  "spoke ServiceAccount ops/lookalike does not allow hub user alice; a spoke admin must add alice to its credbroker.io/allowed-subjects annotation: permission denied",
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "unnamed, several matches; a wildcard-looking entry is literal",
			req:      &credbrokerv1alpha1.MintRequest{Subject: subject(argocd)},
			wantErr:  "several spoke ServiceAccounts allow hub user " + argocd + " (apps/deployer, apps/reader); name one in the request: failed precondition",
			wantCode: errdefs.ErrFailedPrecondition,
		},
		{
			name:   "unnamed, single match",
			req:    &credbrokerv1alpha1.MintRequest{Subject: subject("bob")},
			wantSA: ref("team-a", "builder"),
		},
		{
			name:     "unnamed, no match",
			req:      &credbrokerv1alpha1.MintRequest{Subject: subject("carol")},
			wantErr:  "no spoke ServiceAccount allows hub user carol; a spoke admin must annotate one with credbroker.io/allowed-subjects: permission denied",
			wantCode: errdefs.ErrPermissionDenied,
		},
		{
			name:     "unnamed, several matches across namespaces are listed sorted",
			req:      &credbrokerv1alpha1.MintRequest{Subject: subject(flux)},
			wantErr:  "several spoke ServiceAccounts allow hub user " + flux + " (apps/reader, team-c/sync); name one in the request: failed precondition",
			wantCode: errdefs.ErrFailedPrecondition,
		},
		{
			name:     "unnamed, same name in two namespaces",
			req:      &credbrokerv1alpha1.MintRequest{Subject: subject("alice")},
			wantErr:  "several spoke ServiceAccounts allow hub user alice (team-a/builder, team-b/builder); name one in the request: failed precondition",
			wantCode: errdefs.ErrFailedPrecondition,
		},
		{
			name:   "ambiguity is resolved by naming one",
			req:    &credbrokerv1alpha1.MintRequest{Subject: subject("alice"), ServiceAccount: ref("team-b", "builder")},
			wantSA: ref("team-b", "builder"),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tokens := &fakeTokens{}
			m := newMinter(t, tokens, sas...)
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, tt.req)
			if tt.wantErr != "" {
				requireRefused(t, tokens, resp, err, tt.wantErr, tt.wantCode)
				return
			}
			require.NoError(t, err)
			calls := tokens.Calls()
			require.Len(t, calls, 1)
			assert.Equal(t, tt.wantSA.GetNamespace(), calls[0].namespace)
			assert.Equal(t, tt.wantSA.GetName(), calls[0].name)
			assert.Equal(t, types.UID("uid-"+tt.wantSA.GetNamespace()+"-"+tt.wantSA.GetName()), calls[0].req.UID,
				"the TokenRequest must carry the checked ServiceAccount's UID")
			assert.Equal(t, &authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Secret", Name: "credbroker-grant-1", UID: "grant-uid-1"},
				calls[0].req.Spec.BoundObjectRef, "the token must be bound to its grant")

			assert.Equal(t, fakeToken(tt.wantSA.GetNamespace(), tt.wantSA.GetName()), resp.GetToken())
			assert.Equal(t, tt.wantSA.GetNamespace(), resp.GetServiceAccount().GetNamespace())
			assert.Equal(t, tt.wantSA.GetName(), resp.GetServiceAccount().GetName())
			assert.Equal(t, issuedAt.Add(time.Hour), resp.GetExpirationTime().AsTime())
		})
	}
}

func TestMintValidation(t *testing.T) {
	m := newMinter(t, &fakeTokens{}, serviceAccount("apps", "deployer", argocd))
	tests := []struct {
		name    string
		req     *credbrokerv1alpha1.MintRequest
		wantErr string
	}{
		{name: "nil request", req: nil, wantErr: "mint request is missing: invalid argument"},
		{
			name:    "no subject",
			req:     &credbrokerv1alpha1.MintRequest{ServiceAccount: ref("apps", "deployer")},
			wantErr: "mint request: subject.username is required: invalid argument",
		},
		{
			name:    "empty username",
			req:     &credbrokerv1alpha1.MintRequest{Subject: &credbrokerv1alpha1.Subject{Uid: "u", Groups: []string{"g"}}},
			wantErr: "mint request: subject.username is required: invalid argument",
		},
		{
			name:    "empty service account reference",
			req:     &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: &credbrokerv1alpha1.ObjectReference{}},
			wantErr: "mint request: service_account.namespace is required when service_account is set; service_account.name is required when service_account is set: invalid argument",
		},
		{
			name:    "namespace not a DNS label",
			req:     &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("Apps.prod", "deployer")},
			wantErr: `mint request: service_account.namespace "Apps.prod" is not a valid namespace name: a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?'): invalid argument`,
		},
		{
			name:    "name not a DNS subdomain",
			req:     &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "../deployer")},
			wantErr: `mint request: service_account.name "../deployer" is not a valid ServiceAccount name: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*'): invalid argument`,
		},
		{
			name:    "name too long",
			req:     &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", strings.Repeat("a", 254))},
			wantErr: `mint request: service_account.name "` + strings.Repeat("a", 254) + `" is not a valid ServiceAccount name: must be no more than 253 characters: invalid argument`,
		},
		{
			name:    "empty audience",
			req:     &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), Audiences: []string{"https://kubernetes.default.svc", ""}},
			wantErr: "mint request: audiences[1] is empty; omit audiences to get the spoke API server's default: invalid argument",
		},
		{
			name:    "negative expiration",
			req:     &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ExpirationSeconds: -1},
			wantErr: "mint request: expiration_seconds -1 is negative; use 0 for the maximum: invalid argument",
		},
		{
			name: "every problem at once",
			req: &credbrokerv1alpha1.MintRequest{
				ServiceAccount:    ref("", "deployer"),
				Audiences:         []string{""},
				ExpirationSeconds: -600,
			},
			wantErr: "mint request: subject.username is required; service_account.namespace is required when service_account is set; audiences[0] is empty; omit audiences to get the spoke API server's default; expiration_seconds -600 is negative; use 0 for the maximum: invalid argument",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, tt.req)
			require.EqualError(t, err, tt.wantErr)
			assert.ErrorIs(t, err, errdefs.ErrInvalidArgument)
			assert.Equal(t, codes.InvalidArgument, errdefs.Code(err))
			assert.Nil(t, resp)
		})
	}
}

func TestMintExpirationAndAudiences(t *testing.T) {
	tests := []struct {
		name          string
		min, max      time.Duration
		requested     int64
		audiences     []string
		wantSeconds   int64
		wantAudiences []string
	}{
		{name: "zero means max", requested: 0, wantSeconds: 3600},
		{name: "below min is raised", requested: 1, wantSeconds: 600},
		{name: "just below min is raised", requested: 599, wantSeconds: 600},
		{name: "min is kept", requested: 600, wantSeconds: 600},
		{name: "within bounds is kept", requested: 1800, wantSeconds: 1800},
		{name: "max is kept", requested: 3600, wantSeconds: 3600},
		{name: "above max is lowered", requested: 3601, wantSeconds: 3600},
		{name: "huge is lowered without overflow", requested: 1<<63 - 1, wantSeconds: 3600},
		{name: "custom bounds, zero", min: 20 * time.Minute, max: 24 * time.Hour, requested: 0, wantSeconds: 86400},
		{name: "custom bounds, low", min: 20 * time.Minute, max: 24 * time.Hour, requested: 700, wantSeconds: 1200},
		{
			name:          "allowed audiences pass through in order",
			requested:     900,
			audiences:     []string{"vault", "https://kubernetes.default.svc", "vault"},
			wantSeconds:   900,
			wantAudiences: []string{"vault", "https://kubernetes.default.svc", "vault"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tokens := &fakeTokens{}
			m, err := New(withGrants(Config{
				Tokens:          tokens,
				ServiceAccounts: lister(t, withAudiences(serviceAccount("apps", "deployer", argocd), "vault,https://kubernetes.default.svc")),
				MinExpiration:   tt.min,
				MaxExpiration:   tt.max,
			}, newFakeGrants()))
			require.NoError(t, err)
			resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{
				Subject:           subject(argocd),
				Audiences:         tt.audiences,
				ExpirationSeconds: tt.requested,
			})
			require.NoError(t, err)
			calls := tokens.Calls()
			require.Len(t, calls, 1)
			require.NotNil(t, calls[0].req.Spec.ExpirationSeconds)
			assert.Equal(t, tt.wantSeconds, *calls[0].req.Spec.ExpirationSeconds)
			assert.Equal(t, tt.wantAudiences, calls[0].req.Spec.Audiences)
			assert.Equal(t, issuedAt.Add(time.Duration(tt.wantSeconds)*time.Second), resp.GetExpirationTime().AsTime())
		})
	}
}

func TestMintCreateTokenErrors(t *testing.T) {
	saResource := schema.GroupResource{Resource: "serviceaccounts"}
	tests := []struct {
		name     string
		tokens   *fakeTokens
		ctx      func(context.Context) context.Context
		wantErr  string
		wantCode codes.Code
	}{
		{
			name:     "deleted since the cache saw it",
			tokens:   &fakeTokens{err: apierrors.NewNotFound(saResource, "deployer")},
			wantErr:  "spoke ServiceAccount apps/deployer: not found",
			wantCode: codes.NotFound,
		},
		{
			name: "agent lacks RBAC",
			tokens: &fakeTokens{err: apierrors.NewForbidden(saResource, "deployer",
				errors.New(`User "system:serviceaccount:credbroker:agent" cannot create resource "serviceaccounts/token" in API group "" in the namespace "apps"`))},
			wantErr: `spoke API server forbids the agent to mint tokens for ServiceAccount apps/deployer; grant the agent's ServiceAccount create on serviceaccounts/token: ` +
				`serviceaccounts "deployer" is forbidden: User "system:serviceaccount:credbroker:agent" cannot create resource "serviceaccounts/token" in API group "" in the namespace "apps": unavailable`,
			wantCode: codes.Unavailable,
		},
		{
			name:     "replaced since the cache saw it",
			tokens:   &fakeTokens{err: apierrors.NewConflict(saResource, "deployer", errors.New("the UID in the token request (a) does not match the UID of the service account (b)"))},
			wantErr:  "spoke ServiceAccount apps/deployer was replaced since the agent's cache saw it; retry once the cache catches up: unavailable",
			wantCode: codes.Unavailable,
		},
		{
			name:     "API server failure",
			tokens:   &fakeTokens{err: apierrors.NewInternalError(errors.New("etcdserver: request timed out"))},
			wantErr:  "mint token for spoke ServiceAccount apps/deployer: Internal error occurred: etcdserver: request timed out: unavailable",
			wantCode: codes.Unavailable,
		},
		{
			name:     "API server unreachable",
			tokens:   &fakeTokens{err: errors.New(`Post "https://10.0.0.1:443/api/v1/namespaces/apps/serviceaccounts/deployer/token": dial tcp 10.0.0.1:443: connect: connection refused`)},
			wantErr:  `mint token for spoke ServiceAccount apps/deployer: Post "https://10.0.0.1:443/api/v1/namespaces/apps/serviceaccounts/deployer/token": dial tcp 10.0.0.1:443: connect: connection refused: unavailable`,
			wantCode: codes.Unavailable,
		},
		{
			name:     "no token in the response",
			tokens:   &fakeTokens{empty: true},
			wantErr:  "spoke API server returned no token for ServiceAccount apps/deployer: unavailable",
			wantCode: codes.Unavailable,
		},
		{
			name:     "deadline",
			tokens:   &fakeTokens{err: fmt.Errorf("Post %q: %w", "https://10.0.0.1:443/", context.DeadlineExceeded)},
			wantErr:  `mint token for spoke ServiceAccount apps/deployer: Post "https://10.0.0.1:443/": context deadline exceeded`,
			wantCode: codes.DeadlineExceeded,
		},
		{
			name:   "canceled caller, error that does not say so",
			tokens: &fakeTokens{err: errors.New("client rate limiter Wait returned an error")},
			ctx: func(ctx context.Context) context.Context {
				ctx, cancel := context.WithCancel(ctx)
				cancel()
				return ctx
			},
			wantErr:  "mint token for spoke ServiceAccount apps/deployer: client rate limiter Wait returned an error: context canceled",
			wantCode: codes.Canceled,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newMinter(t, tt.tokens, serviceAccount("apps", "deployer", argocd))
			ctx := t.Context()
			if tt.ctx != nil {
				ctx = tt.ctx(ctx)
			}
			resp, err := m.Mint(ctx, fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd), ServiceAccount: ref("apps", "deployer")})
			require.EqualError(t, err, tt.wantErr)
			assert.Equal(t, tt.wantCode, errdefs.Code(err))
			assert.Nil(t, resp)
		})
	}
}

// capture returns a logger whose lines land in the returned builder.
func capture() (logr.Logger, *strings.Builder) {
	var mu sync.Mutex
	var b strings.Builder
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		defer mu.Unlock()
		b.WriteString(args)
		b.WriteString("\n")
	}, funcr.Options{Verbosity: 10})
	return log, &b
}

func TestMintLogsWithoutToken(t *testing.T) {
	log, lines := capture()
	tokens := &fakeTokens{}
	m, err := New(withGrants(Config{
		Tokens:          tokens,
		ServiceAccounts: lister(t, withAudiences(serviceAccount("apps", "deployer", argocd), "vault")),
		Log:             log,
	}, newFakeGrants()))
	require.NoError(t, err)

	resp, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{
		Subject:           subject(argocd),
		Audiences:         []string{"vault"},
		ExpirationSeconds: 900,
	})
	require.NoError(t, err)
	_, err = m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject("mallory")})
	require.ErrorIs(t, err, errdefs.ErrPermissionDenied)

	got := lines.String()
	assert.Equal(t,
		`"level"=0 "msg"="minted spoke token" "subject"="`+argocd+`" "serviceAccount"="apps/deployer" "audiences"=["vault"] "expiration"="2026-03-01T12:15:00Z" "credentialID"="JTI=jti-apps-deployer" "grant"="apps/credbroker-grant-1" "clusterProfile"=""`+"\n"+
			`"level"=0 "msg"="refused mint request" "subject"="mallory" "err"="no spoke ServiceAccount allows hub user mallory; a spoke admin must annotate one with credbroker.io/allowed-subjects: permission denied"`+"\n",
		got)
	tok := resp.GetToken()
	for _, part := range strings.Split(tok, ".") {
		assert.NotContains(t, got, part, "the log must not contain any part of the token")
	}
}

func TestMintZeroLoggerDiscards(t *testing.T) {
	m, err := New(withGrants(Config{Tokens: &fakeTokens{}, ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))}, newFakeGrants()))
	require.NoError(t, err)
	_, err = m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(argocd)})
	require.NoError(t, err)
	_, err = m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject("mallory")})
	require.Error(t, err)
}

func TestMintConcurrent(t *testing.T) {
	tokens := &fakeTokens{}
	m := newMinter(t, tokens, serviceAccount("apps", "deployer", argocd), serviceAccount("apps", "reader", flux))
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() {
			user := argocd
			if i%2 == 1 {
				user = flux
			}
			_, err := m.Mint(t.Context(), fleet.ClusterRef{}, &credbrokerv1alpha1.MintRequest{Subject: subject(user)})
			assert.NoError(t, err)
		})
	}
	wg.Wait()
	assert.Len(t, tokens.Calls(), 20)
}

func TestAllowedSubjects(t *testing.T) {
	tests := []struct {
		name string
		sa   *corev1.ServiceAccount
		want []string
	}{
		{name: "nil", sa: nil, want: nil},
		{name: "no annotations", sa: serviceAccount("a", "b", ""), want: nil},
		{name: "other annotations only", sa: &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{"credbroker.io/other": "alice"}}}, want: nil},
		{name: "empty", sa: &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{AllowedSubjectsAnnotation: ""}}}, want: nil},
		{name: "only separators and spaces", sa: serviceAccount("a", "b", " , ,\t,"), want: nil},
		{name: "one", sa: serviceAccount("a", "b", argocd), want: []string{argocd}},
		{name: "several, trimmed, empties dropped, order kept", sa: serviceAccount("a", "b", " bob ,, alice,\n"+argocd+" ,"), want: []string{"bob", "alice", argocd}},
		{name: "inner spaces kept", sa: serviceAccount("a", "b", "first last"), want: []string{"first last"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, AllowedSubjects(tt.sa))
		})
	}
}

// The attack: a hub subject in so many groups (an SSO user in 2,000 of
// them) that the grant of its token is larger than an agent reports to the
// brokers. The token was minted and its grant left out of every report:
// no broker could list it, or revoke it by subject or ServiceAccount, for
// its whole life. The agent refuses such a mint before it writes anything.
func TestMintRefusesAGrantTooLargeToReport(t *testing.T) {
	mint := func(t *testing.T, groups int) (*Minter, *fakeTokens, *fakeGrants, error) {
		t.Helper()
		tokens, grants := &fakeTokens{}, newFakeGrants()
		m, err := New(withGrants(Config{Tokens: tokens, ServiceAccounts: lister(t, serviceAccount("apps", "deployer", argocd))}, grants))
		require.NoError(t, err)
		s := subject(argocd)
		for i := range groups {
			s.Groups = append(s.Groups, fmt.Sprintf("team-%04d.groups.example.com", i))
		}
		_, err = m.Mint(t.Context(), poolCluster, &credbrokerv1alpha1.MintRequest{Subject: s, ServiceAccount: ref("apps", "deployer")})
		return m, tokens, grants, err
	}

	t.Run("2,000 groups", func(t *testing.T) {
		_, tokens, written, err := mint(t, 2000)
		require.ErrorContains(t, err, "the grant of a token for spoke ServiceAccount apps/deployer would report")
		assert.Equal(t, codes.InvalidArgument, errdefs.Code(err))
		assert.Empty(t, tokens.Calls(), "a token was minted")
		written.mu.Lock()
		defer written.mu.Unlock()
		assert.Empty(t, written.secrets, "a grant was written")
	})
	t.Run("as many groups as fit", func(t *testing.T) {
		// The most groups a mint takes: its grant, as the agent reports
		// it, fits what a broker holds, in a frame of its own.
		most := sort.Search(2000, func(n int) bool { _, _, _, err := mint(t, n); return err != nil }) - 1
		m, _, _, err := mint(t, most)
		require.NoError(t, err)
		reported := m.Snapshot()
		require.Len(t, reported, 1)
		assert.LessOrEqual(t, proto.Size(reported[0])+4, grants.DefaultMaxGrantBytes, "a grant the agent wrote is more than a broker holds")
		t.Logf("%d groups fit; the grant reports %d bytes", most, proto.Size(reported[0]))
	})
}
