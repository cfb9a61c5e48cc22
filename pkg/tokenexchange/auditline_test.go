package tokenexchange

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	authnclient "k8s.io/client-go/kubernetes/typed/authentication/v1"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/hubauth"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// attackSegment is the start of a JWT header that a caller, the hub or an
// agent puts where the audit line quotes it.
const attackSegment = "eyJhbGciOiJSUzI1NiIsImtpZCI6ImF0dGFja2VyLWNvbnRyb2xsZWQta2V5LWlkIn0"

// The attack on the encoder's shortcut (the values the service formats
// skip the token scan): a token segment in every field of the exchange's
// audit line that a caller, the hub or an agent controls, through real
// exchanges: refused requests quoted as received, clipped and not
// (cluster, requested ServiceAccount, audiences, and the refusal that
// quotes them), an
// allowed one whose hub user and uid, audiences, ServiceAccount name and
// jti are token-shaped (a ServiceAccount name passes validation only as
// 64 characters without a dot), and an agent's refusal that quotes a
// segment. Each field is checked on its own, so that removing the scan of
// any one of them fails the test.
func TestAuditLineRedactsEveryControlledField(t *testing.T) {
	seg := func(field string) string { return attackSegment + field }
	long := strings.Repeat("x", 64)
	var audit lockedBuffer
	f := newFixture(t, func(c *Config) {
		c.AuditLog = &audit
		c.TokenReviews = reviewsAs{TokenReviewInterface: c.TokenReviews, user: seg("user"), uid: seg("uid")}
		c.AccessReviews = allowAll{}
	})
	f.minter.tamper = func(resp *pb.MintResponse) {
		c, err := token.ParseClaims(resp.GetToken())
		require.NoError(t, err)
		resp.Token = spokeToken(c.Subject, c.Audiences, c.Expiry, seg("jti"))
	}
	ctx := withBearer(consumerToken)

	refused := &pb.ExchangeRequest{
		Cluster:        &pb.ObjectReference{Namespace: seg("clusterNS"), Name: seg("cluster")},
		ServiceAccount: &pb.ObjectReference{Namespace: seg("saNS"), Name: seg("sa")},
		Audiences:      []string{seg("aud")},
	}
	_, err := f.svc.Exchange(ctx, refused)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)

	allowed := &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: "fleet", Name: "a"},
		ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: long}, Audiences: []string{seg("aud")}}
	_, err = f.svc.Exchange(ctx, allowed)
	require.NoError(t, err)

	f.minter.err = fmt.Errorf("the agent refused audience %q: %w", seg("agentReason"), errdefs.ErrPermissionDenied)
	allowed.Audiences = []string{"other"}
	_, err = f.svc.Exchange(ctx, allowed)
	require.Equal(t, codes.PermissionDenied, status.Code(err), "%v", err)

	// Short enough not to be clipped: each side is scanned on its own.
	short := func(field string) string { return attackSegment[:16] + field }
	refused = &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: short("ns"), Name: short("cluster")},
		ServiceAccount: &pb.ObjectReference{Namespace: short("ns"), Name: short("sa")}}
	_, err = f.svc.Exchange(ctx, refused)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)

	lines := strings.Split(strings.TrimSuffix(audit.String(), "\n"), "\n")
	require.Len(t, lines, 4)
	assert.NotContains(t, audit.String(), attackSegment[:24])
	assert.NotContains(t, audit.String(), long)
	for _, tt := range []struct {
		line  int
		field string
		want  int // values redacted: a namespace/name holds two
	}{
		{0, "cluster", 1}, {0, "requestedServiceAccount", 1}, {0, "audiences", 1}, {0, "user", 1}, {0, "uid", 1}, {0, "reason", 1},
		{1, "audiences", 1}, {1, "serviceAccount", 1}, {1, "tokenAudiences", 1}, {1, "credentialID", 1},
		{2, "reason", 1},
		{3, "cluster", 2}, {3, "requestedServiceAccount", 2},
	} {
		var l map[string]any
		require.NoError(t, json.Unmarshal([]byte(lines[tt.line]), &l), lines[tt.line])
		value := fmt.Sprint(l[tt.field])
		assert.GreaterOrEqual(t, strings.Count(value, "[redacted sha256:"), tt.want, "line %d, %s: %s", tt.line, tt.field, value)
	}
}

// Each exchange writes its line whole, with one Write, from whatever
// goroutine: --audit-log-mode=blocking makes it one write(2), and batch
// never splits a Write.
func TestAuditLineIsOneWrite(t *testing.T) {
	var audit lockedBuffer
	f := newFixture(t, func(c *Config) { c.AuditLog = &audit })
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() {
			_, err := f.svc.Exchange(withBearer(consumerToken), fleetA())
			assert.NoError(t, err)
		})
	}
	wg.Wait()
	require.Len(t, audit.writes, 20)
	for _, w := range audit.writes {
		assert.True(t, json.Valid([]byte(w)), w)
		assert.Equal(t, 1, strings.Count(w, "\n"), w)
		assert.True(t, strings.HasSuffix(w, "}\n"), w)
	}
}

// The encoder writes what the broker binary's slog audit logger wrote for
// the same exchange, byte for byte but the time: same keys, same order,
// same value formats and escapes, same redaction.
func TestAuditLineIsTheSlogLine(t *testing.T) {
	for name, in := range map[string]auditInput{
		"cached":        {hit: true, withUser: true, withMinted: true},
		"refused":       {clusterNS: "fleet", clusterName: "b", withUser: true, reason: "hub RBAC does not allow it"},
		"as received":   {clusterNS: strings.Repeat("n", 70), saName: "é\u2028\x00\b\f\t\"\\<>&\xff", aud1: "\b\f\x01\xff\u2029", aud2: strings.Repeat("a", 300)},
		"token-shaped":  {clusterName: attackSegment, aud1: attackSegment + ".x", user: attackSegment, withUser: true, withMinted: true, mintedName: strings.Repeat("z", 70), reason: "quoted " + attackSegment},
		"no request":    {},
		"long clipping": {clusterNS: strings.Repeat("é", 40), aud1: strings.Repeat("é", 40)},
	} {
		t.Run(name, func(t *testing.T) {
			in.check(t)
		})
	}
}

// Any input makes one valid JSON line without a token-shaped run in any
// string, the slog audit logger's line but the time.
func FuzzAuditLine(f *testing.F) {
	f.Add("fleet", "a", "spoke", "reader", "https://kubernetes.default.svc", "", "system:serviceaccount:hub:consumer", "uid",
		"spoke", "reader", "JTI=minted-1", "", true, true, true, int64(137000))
	f.Add(attackSegment, "x\xff\u2028", "\b\f", strings.Repeat("q", 80), attackSegment+"."+attackSegment, "\x00",
		attackSegment, "\"\\", strings.Repeat("a", 64), "b", "JTI="+attackSegment, "refused "+attackSegment, false, true, true, int64(-1))
	f.Fuzz(func(t *testing.T, clusterNS, clusterName, saNS, saName, aud1, aud2, user, uid, mintedNS, mintedName, jti, reason string,
		hit, withUser, withMinted bool, latency int64) {
		in := auditInput{clusterNS: clusterNS, clusterName: clusterName, saNS: saNS, saName: saName, aud1: aud1, aud2: aud2,
			user: user, uid: uid, mintedNS: mintedNS, mintedName: mintedName, jti: jti, reason: reason,
			hit: hit, withUser: withUser, withMinted: withMinted, latency: time.Duration(latency)}
		in.check(t)
	})
}

// auditInput is what an exchange's audit line holds.
type auditInput struct {
	clusterNS, clusterName, saNS, saName, aud1, aud2 string
	user, uid, mintedNS, mintedName, jti, reason     string
	hit, withUser, withMinted                        bool
	latency                                          time.Duration
}

// check encodes the line of in and checks it: one valid JSON object, no
// token-shaped run in its strings, and the slog logger's line but the time.
func (in auditInput) check(t *testing.T) {
	t.Helper()
	req := &pb.ExchangeRequest{}
	if in.clusterNS+in.clusterName != "" {
		req.Cluster = &pb.ObjectReference{Namespace: in.clusterNS, Name: in.clusterName}
	}
	if in.saNS+in.saName != "" {
		req.ServiceAccount = &pb.ObjectReference{Namespace: in.saNS, Name: in.saName}
	}
	for _, a := range []string{in.aud1, in.aud2} {
		if a != "" {
			req.Audiences = append(req.Audiences, a)
		}
	}
	rec := &auditRecord{cacheHit: in.hit}
	if in.withUser {
		rec.user, rec.authenticated = hubauth.User{Username: in.user, UID: in.uid}, true
	}
	if in.withMinted {
		rec.minted = minted{serviceAccount: types.NamespacedName{Namespace: in.mintedNS, Name: in.mintedName},
			audiences: req.GetAudiences(), expiry: t0.Add(time.Hour), credentialID: in.jti}
		rec.answered = true
	}
	var err error
	if in.reason != "" {
		err = errors.New(in.reason)
	}
	code := errdefs.Code(err)
	now := time.Now()
	line := appendAuditLine(nil, now, rec, req, code, err, in.latency)

	require.True(t, json.Valid(line), "not JSON: %s", line)
	require.Equal(t, 1, bytes.Count(line, []byte("\n")), "not one line: %q", line)
	var decoded map[string]any
	require.NoError(t, json.Unmarshal(line, &decoded))
	assert.Equal(t, now.Format(time.RFC3339Nano), decoded["time"])
	noTokenIn(t, decoded, line)

	var slogged bytes.Buffer
	cmdflags.AuditLogger(&slogged).Info("exchange", auditValues(rec, req, code, err, in.latency)...)
	assert.Equal(t, withoutTime(slogged.String()), withoutTime(string(line)))
}

// noTokenIn fails when a string in v, a decoded JSON value, holds a
// token-shaped run.
func noTokenIn(t *testing.T, v any, line []byte) {
	t.Helper()
	switch v := v.(type) {
	case string:
		assert.Equal(t, token.Redact(v), v, "a token-shaped run in %s", line)
	case []any:
		for _, e := range v {
			noTokenIn(t, e, line)
		}
	case map[string]any:
		for _, e := range v {
			noTokenIn(t, e, line)
		}
	}
}

func withoutTime(line string) string {
	_, rest, _ := strings.Cut(line, `","level":`)
	return rest
}

// lockedBuffer is an audit log for tests that keeps each Write apart.
type lockedBuffer struct {
	mu     sync.Mutex
	writes []string
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.writes = append(b.writes, string(p))
	return len(p), nil
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Join(b.writes, "")
}

// reviewsAs authenticates as the fake hub does, but as user and uid.
type reviewsAs struct {
	authnclient.TokenReviewInterface
	user, uid string
}

func (r reviewsAs) Create(ctx context.Context, tr *authenticationv1.TokenReview, opts metav1.CreateOptions) (*authenticationv1.TokenReview, error) {
	out, err := r.TokenReviewInterface.Create(ctx, tr, opts)
	if err == nil && out.Status.Authenticated {
		out.Status.User.Username, out.Status.User.UID = r.user, r.uid
	}
	return out, err
}

// allowAll is a hub whose RBAC allows everything.
type allowAll struct{}

func (allowAll) Create(_ context.Context, sar *authorizationv1.SubjectAccessReview, _ metav1.CreateOptions) (*authorizationv1.SubjectAccessReview, error) {
	out := sar.DeepCopy()
	out.Status.Allowed = true
	return out, nil
}
