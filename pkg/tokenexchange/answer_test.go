package tokenexchange

import (
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

func TestCheckAnswer(t *testing.T) {
	const sub = "system:serviceaccount:spoke:reader"
	exp := t0.Add(time.Hour)
	reader := types.NamespacedName{Namespace: "spoke", Name: "reader"}
	answer := func(tok string, expirationTime time.Time) *pb.MintResponse {
		return &pb.MintResponse{Token: tok, ExpirationTime: timestamppb.New(expirationTime), ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "reader"}}
	}
	named := request{serviceAccount: reader, audiences: []string{"a", "b"}}
	tests := []struct {
		name      string
		resp      *pb.MintResponse
		req       request
		wantCheck string
		wantErr   string
	}{
		{name: "honest", resp: answer(spokeToken(sub, []string{"a", "b"}, exp, "j"), exp), req: named},
		{name: "agent picked the ServiceAccount", resp: answer(spokeToken(sub, []string{"a", "b"}, exp, "j"), exp), req: request{audiences: []string{"a", "b"}}},
		{name: "audiences in another order, repeated", resp: answer(spokeToken(sub, []string{"b", "a", "b"}, exp, "j"), exp), req: named},
		{name: "spoke's default audiences", resp: answer(spokeToken(sub, []string{"https://kubernetes.default.svc", "k3s"}, exp, "j"), exp)},
		{
			name: "the broker's own audience among the defaults", resp: answer(spokeToken(sub, []string{"https://kubernetes.default.svc", "credbroker"}, exp, "j"), exp),
			wantCheck: "aud", wantErr: `aud: aud holds "credbroker", the broker's own audience`,
		},
		{name: "aud as one string", resp: answer(jwt(`{"sub":"`+sub+`","aud":"a","exp":`+unix(exp)+`}`), exp), req: request{audiences: []string{"a"}}},
		{name: "exp at the latest allowed", resp: answer(spokeToken(sub, []string{"a", "b"}, t0.Add(time.Hour+fleet.MaxClockSkew), "j"), t0.Add(time.Hour+fleet.MaxClockSkew)), req: named},
		{name: "expiration_time a second before exp", resp: answer(spokeToken(sub, []string{"a", "b"}, exp, "j"), exp.Add(-time.Second)), req: named},
		{name: "expiration_time with nanoseconds", resp: answer(spokeToken(sub, []string{"a", "b"}, exp, "j"), exp.Add(-300*time.Millisecond)), req: named},
		// kube-apiserver reads its clock for the status before admission and
		// the live GET of the bound object (the agent's grant Secret), and
		// again for exp: on a loaded API server, seconds apart.
		{name: "expiration_time two seconds before exp, as a loaded API server answers", resp: answer(spokeToken(sub, []string{"a", "b"}, exp, "j"), exp.Add(-2*time.Second)), req: named},
		{name: "expiration_time fleet.MaxClockSkew before exp", resp: answer(spokeToken(sub, []string{"a", "b"}, exp, "j"), exp.Add(-fleet.MaxClockSkew)), req: named},

		{
			name: "not a jwt", resp: answer("opaque", exp), req: named,
			wantCheck: "claims", wantErr: "claims: bearer token is not a JWT: 1 segments, want 3",
		},
		{
			name: "claims not json", resp: answer(jwt(`nope`), exp), req: named,
			wantCheck: "claims", wantErr: "claims: token claims are malformed: the payload is not a JSON object",
		},
		{
			name: "no ServiceAccount in the answer", resp: &pb.MintResponse{Token: spokeToken(sub, []string{"a", "b"}, exp, "j"), ExpirationTime: timestamppb.New(exp)}, req: named,
			wantCheck: "service_account", wantErr: `service_account: the answer names no valid ServiceAccount ("/")`,
		},
		{
			name: "invalid ServiceAccount in the answer", req: request{audiences: []string{"a"}},
			resp: &pb.MintResponse{
				Token: spokeToken("system:serviceaccount:spoke:a:b", []string{"a"}, exp, "j"), ExpirationTime: timestamppb.New(exp),
				ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "a:b"},
			},
			wantCheck: "service_account", wantErr: `service_account: the answer names no valid ServiceAccount ("spoke/a:b")`,
		},
		{
			name: "another ServiceAccount than requested", req: named,
			resp: &pb.MintResponse{
				Token: spokeToken("system:serviceaccount:kube-system:admin", []string{"a", "b"}, exp, "j"), ExpirationTime: timestamppb.New(exp),
				ServiceAccount: &pb.ObjectReference{Namespace: "kube-system", Name: "admin"},
			},
			wantCheck: "service_account", wantErr: "service_account: the answer names ServiceAccount kube-system/admin, not the requested spoke/reader",
		},
		{
			name: "token for another ServiceAccount than the answer names", req: named,
			resp:      answer(spokeToken("system:serviceaccount:kube-system:admin", []string{"a", "b"}, exp, "j"), exp),
			wantCheck: "sub", wantErr: `sub: sub "system:serviceaccount:kube-system:admin" is not "system:serviceaccount:spoke:reader", the ServiceAccount the answer names`,
		},
		{
			name: "token for another ServiceAccount when the agent picked", req: request{audiences: []string{"a", "b"}},
			resp:      answer(spokeToken("system:serviceaccount:kube-system:admin", []string{"a", "b"}, exp, "j"), exp),
			wantCheck: "sub", wantErr: `sub: sub "system:serviceaccount:kube-system:admin" is not "system:serviceaccount:spoke:reader", the ServiceAccount the answer names`,
		},
		{
			name: "no sub", req: named, resp: answer(jwt(`{"aud":["a","b"],"exp":`+unix(exp)+`}`), exp),
			wantCheck: "sub", wantErr: `sub: sub "" is not "system:serviceaccount:spoke:reader", the ServiceAccount the answer names`,
		},
		{
			name: "another audience", req: named, resp: answer(spokeToken(sub, []string{"sts.amazonaws.com"}, exp, "j"), exp),
			wantCheck: "aud", wantErr: `aud: aud ["sts.amazonaws.com"] is not the requested ["a" "b"]`,
		},
		{
			name: "an audience more", req: named, resp: answer(spokeToken(sub, []string{"a", "b", "c"}, exp, "j"), exp),
			wantCheck: "aud", wantErr: `aud: aud ["a" "b" "c"] is not the requested ["a" "b"]`,
		},
		{
			name: "an audience less", req: named, resp: answer(spokeToken(sub, []string{"a"}, exp, "j"), exp),
			wantCheck: "aud", wantErr: `aud: aud ["a"] is not the requested ["a" "b"]`,
		},
		{
			name: "no aud", req: named, resp: answer(jwt(`{"sub":"`+sub+`","exp":`+unix(exp)+`}`), exp),
			wantCheck: "aud", wantErr: `aud: aud [] is not the requested ["a" "b"]`,
		},
		{
			name: "no aud when none was requested", resp: answer(jwt(`{"sub":"`+sub+`","exp":`+unix(exp)+`}`), exp),
			wantCheck: "aud", wantErr: "aud: aud has 0 audiences; want 1 to 16",
		},
		{
			name: "empty audience when none was requested", resp: answer(spokeToken(sub, []string{""}, exp, "j"), exp),
			wantCheck: "aud", wantErr: `aud: aud "" is not 1 to 256 printable characters`,
		},
		{
			name: "audience with a line break when none was requested", resp: answer(spokeToken(sub, []string{"a\nb"}, exp, "j"), exp),
			wantCheck: "aud", wantErr: `aud: aud "a\nb" is not 1 to 256 printable characters`,
		},
		{
			name: "too many audiences when none was requested", resp: answer(spokeToken(sub, strings.Split(strings.Repeat("a,", 17), ",")[:17], exp, "j"), exp),
			wantCheck: "aud", wantErr: "aud: aud has 17 audiences; want 1 to 16",
		},
		{
			name: "no exp", req: named, resp: answer(jwt(`{"sub":"`+sub+`","aud":["a","b"]}`), exp),
			wantCheck: "exp", wantErr: "exp: the token has no exp",
		},
		{
			name: "expired", req: named, resp: answer(spokeToken(sub, []string{"a", "b"}, t0, "j"), t0),
			wantCheck: "exp", wantErr: "exp: exp 2026-01-01T00:00:00Z is not after now (2026-01-01T00:00:00Z)",
		},
		{
			name: "a year long", req: named, resp: answer(spokeToken(sub, []string{"a", "b"}, t0.Add(365*24*time.Hour), "j"), t0.Add(365*24*time.Hour)),
			wantCheck: "exp", wantErr: "exp: exp 2027-01-01T00:00:00Z is later than 2026-01-01T01:01:00Z, the maximum expiration 1h0m0s and 1m0s of clock skew from now",
		},
		{
			name: "a second past the skew", req: named,
			resp:      answer(spokeToken(sub, []string{"a", "b"}, t0.Add(time.Hour+fleet.MaxClockSkew+time.Second), "j"), t0.Add(time.Hour+fleet.MaxClockSkew+time.Second)),
			wantCheck: "exp", wantErr: "exp: exp 2026-01-01T01:01:01Z is later than 2026-01-01T01:01:00Z, the maximum expiration 1h0m0s and 1m0s of clock skew from now",
		},
		{
			name: "no expiration_time", req: named,
			resp:      &pb.MintResponse{Token: spokeToken(sub, []string{"a", "b"}, exp, "j"), ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "reader"}},
			wantCheck: "expiration_time", wantErr: "expiration_time: expiration_time is missing or invalid",
		},
		{
			name: "expiration_time later than exp", req: named, resp: answer(spokeToken(sub, []string{"a", "b"}, t0.Add(10*time.Minute), "j"), exp),
			wantCheck: "expiration_time", wantErr: "expiration_time: expiration_time 2026-01-01T01:00:00Z is not exp 2026-01-01T00:10:00Z, nor less than 1m0s before it",
		},
		{
			name: "expiration_time a second after exp", req: named, resp: answer(spokeToken(sub, []string{"a", "b"}, exp, "j"), exp.Add(time.Second)),
			wantCheck: "expiration_time", wantErr: "expiration_time: expiration_time 2026-01-01T01:00:01Z is not exp 2026-01-01T01:00:00Z, nor less than 1m0s before it",
		},
		{
			name: "expiration_time more than fleet.MaxClockSkew before exp", req: named, resp: answer(spokeToken(sub, []string{"a", "b"}, exp, "j"), exp.Add(-fleet.MaxClockSkew-time.Second)),
			wantCheck: "expiration_time", wantErr: "expiration_time: expiration_time 2026-01-01T00:58:59Z is not exp 2026-01-01T01:00:00Z, nor less than 1m0s before it",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := checkAnswer(tt.resp, tt.req, "credbroker", t0, time.Hour)
			if tt.wantErr != "" {
				require.EqualError(t, err, tt.wantErr)
				assert.Equal(t, tt.wantCheck, checkOf(err))
				assert.NotContains(t, err.Error(), tt.resp.GetToken())
				return
			}
			require.NoError(t, err)
			claims := claimsOf(t, tt.resp.GetToken())
			assert.Equal(t, tt.resp.GetToken(), got.token)
			assert.Equal(t, reader, got.serviceAccount)
			assert.Equal(t, claims.Expiry, got.expiry, "the expiry is the token's exp, not the agent's expiration_time")
			assert.Equal(t, claims.Audiences, got.audiences)
		})
	}
}

func unix(t time.Time) string { return strconv.FormatInt(t.Unix(), 10) }

func claimsOf(t *testing.T, tok string) token.Claims {
	t.Helper()
	c, err := token.ParseClaims(tok)
	require.NoError(t, err)
	return c
}

// The service refuses a rogue answer with Unavailable, logs which check it
// failed, audits no claims and caches nothing.
func TestExchangeRefusesAnswerThatFailsChecks(t *testing.T) {
	var mu sync.Mutex
	var logs strings.Builder
	f := newFixture(t, func(c *Config) {
		c.Log = funcr.New(func(prefix, args string) {
			mu.Lock()
			defer mu.Unlock()
			logs.WriteString(args + "\n")
		}, funcr.Options{})
	})
	var rogue string
	f.minter.tamper = func(r *pb.MintResponse) {
		r.Token = spokeToken("system:serviceaccount:kube-system:admin", []string{"https://kubernetes.default.svc"}, f.clock.Now().Add(time.Hour), "rogue")
		rogue = r.Token
	}
	_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	assert.Equal(t, codes.Unavailable, status.Code(err))
	assert.Equal(t, "the agent of cluster fleet/a answered with a token that failed the broker's checks: unavailable", status.Convert(err).Message())

	mu.Lock()
	logged := logs.String()
	mu.Unlock()
	assert.Contains(t, logged, `"msg"="agent answer failed the broker's checks"`)
	assert.Contains(t, logged, `"cluster"="fleet/a" "check"="sub"`)
	assert.NotContains(t, logged, rogue)
	audit := f.audit.String()
	assert.Contains(t, audit, `"code"="Unavailable"`)
	assert.NotContains(t, audit, `"credentialID"`)
	assert.NotContains(t, audit, rogue)

	f.minter.tamper = nil
	resp, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	assert.Equal(t, "JTI=minted-2", resp.GetCredentialId(), "the rogue answer was not cached")
	assert.Equal(t, int32(2), f.minter.calls.Load())
}

// The consumer and the audit line get the token's exp, not the agent's
// expiration_time, when the two differ by the second that kube-apiserver
// allows.
func TestExchangeAnswersTheTokensExp(t *testing.T) {
	f := newFixture(t)
	f.minter.tamper = func(r *pb.MintResponse) {
		r.ExpirationTime = timestamppb.New(r.GetExpirationTime().AsTime().Add(-700 * time.Millisecond))
	}
	resp, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
	require.NoError(t, err)
	assert.Equal(t, t0.Add(time.Hour), resp.GetExpirationTime().AsTime())
	assert.Contains(t, f.audit.String(), `"expiration"="2026-01-01T01:00:00Z"`)
}

func FuzzCheckAnswer(f *testing.F) {
	exp := t0.Add(time.Hour)
	f.Add(spokeToken("system:serviceaccount:spoke:reader", []string{"a"}, exp, "j"), exp.Unix(), "a")
	f.Add(jwt(`{"sub":"system:serviceaccount:spoke:reader","aud":"a","exp":1767229200}`), exp.Unix(), "")
	f.Add(jwt(`{"aud":[1]}`), int64(0), "a")
	f.Add("a.b.c", int64(-1), "")
	f.Fuzz(func(t *testing.T, tok string, expirationTime int64, aud string) {
		var r request
		if aud != "" {
			r.audiences = []string{aud}
		}
		resp := &pb.MintResponse{Token: tok, ExpirationTime: &timestamppb.Timestamp{Seconds: expirationTime},
			ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "reader"}}
		got, err := checkAnswer(resp, r, "credbroker", t0, time.Hour)
		if err != nil {
			if len(tok) > 3 && strings.Contains(err.Error(), tok) {
				t.Fatalf("error %q repeats the token", err)
			}
			if checkOf(err) == "unknown" {
				t.Fatalf("error %v names no check", err)
			}
			return
		}
		if !got.expiry.After(t0) || got.expiry.After(t0.Add(time.Hour+fleet.MaxClockSkew)) {
			t.Fatalf("expiry %v passed the checks", got.expiry)
		}
		if got.serviceAccount.String() != "spoke/reader" || len(got.audiences) == 0 {
			t.Fatalf("claims %+v passed the checks", got)
		}
	})
}
