package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// auditLine is one line of a replica's audit log.
type auditLine map[string]any

func (l auditLine) str(key string) string { s, _ := l[key].(string); return s }

// readAudit reads every replica's audit log (--audit-log-path) as the
// binary writes it. Every line must be one JSON object.
func readAudit(t *testing.T) (lines []auditLine, raw string) {
	return readAuditWith(t, "")
}

// readAuditWith is readAudit of only the lines that hold substr, which
// spares a poll the decoding of a suite's worth of lines.
func readAuditWith(t *testing.T, substr string) (lines []auditLine, raw string) {
	t.Helper()
	var all strings.Builder
	for _, name := range deployment.AuditLogs() {
		data, err := os.ReadFile(name)
		require.NoError(t, err)
		all.Write(data)
		sc := bufio.NewScanner(strings.NewReader(string(data)))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			if !strings.Contains(sc.Text(), substr) {
				continue
			}
			var l auditLine
			require.NoError(t, json.Unmarshal(sc.Bytes(), &l), "an audit line is not JSON: %q", sc.Text())
			lines = append(lines, l)
		}
		require.NoError(t, sc.Err())
	}
	return lines, all.String()
}

// waitAudit waits, for 30 s at most, until the lines of the audit logs
// that hold substr match as many times as there are broker replicas; on
// timeout the test fails, and goes on, with what and the last of those
// lines.
func waitAudit(t *testing.T, what, substr string, match func(auditLine) bool) {
	t.Helper()
	assert.EventuallyWithT(t, func(c *assert.CollectT) {
		lines, _ := readAuditWith(t, substr)
		assert.GreaterOrEqual(c, countAudit(lines, match), len(deployment.Brokers), "matching audit lines; the last lines with %q: %v",
			substr, lines[max(0, len(lines)-3):])
	}, 30*time.Second, 100*time.Millisecond, "waiting for %s", what)
}

func countAudit(lines []auditLine, match func(auditLine) bool) int {
	n := 0
	for _, l := range lines {
		if match(l) {
			n++
		}
	}
	return n
}

// jwtSegment matches the start of a JWT's header or payload segment: the
// base64url of `{"`.
var jwtSegment = regexp.MustCompile(`eyJ[A-Za-z0-9_-]{8,}`)

// The broker's audit log (what --audit-log-path receives) records every
// exchange, allowed or refused, and every agent connect, disconnect and
// refusal, as JSON lines apart from the operational logs; and it holds no
// token, whole or in part: not a token the consumers sent, not one they
// received, and not any of their three segments, even when a consumer puts
// them in its request where they are echoed back in a refusal.
func TestAuditLog(t *testing.T) {
	ctx := context.Background()
	require.Len(t, deployment.AuditLogs(), len(deployment.Brokers), "one audit log per replica")
	spoke := env.Spokes[0]
	// A ClusterProfile of this test's own, served by an agent it starts
	// and stops, so that its agent lines are this test's.
	profile := uniqueName(t, "audited")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, profile, spoke.Access(plugin.Name, nil))
	require.NoError(t, err)

	c := newConsumer(t, "credbroker", spoke.Name, profile)
	saNS := optIn(t, spoke, "audited-sa", c.username())
	sa := &pb.ObjectReference{Namespace: saNS, Name: "audited-sa"}
	tokens := []string{c.token}

	type wantExchange struct {
		what, user, cluster, code, credentialID string
	}
	var wants []wantExchange

	// Allowed, through each replica.
	for i, b := range deployment.Brokers {
		resp, err := exchangeVia(t, exchangeClientAt(t, b.ExchangeAddr()), c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), ServiceAccount: sa})
		require.NoError(t, err)
		tokens = append(tokens, resp.GetToken())
		wants = append(wants, wantExchange{what: "allowed via replica " + string(rune('0'+i)), user: c.username(),
			cluster: framework.FleetNamespace + "/" + spoke.Name, code: "OK", credentialID: resp.GetCredentialId()})
	}

	// Refused by hub RBAC.
	stranger := newConsumer(t, "credbroker")
	tokens = append(tokens, stranger.token)
	_, err = exchange(t, stranger, &pb.ExchangeRequest{Cluster: clusterRef(spoke)})
	require.Equal(t, codes.PermissionDenied, status.Code(err))
	wants = append(wants, wantExchange{what: "no hub RBAC", user: stranger.username(), cluster: framework.FleetNamespace + "/" + spoke.Name, code: "PermissionDenied"})

	// Refused as unauthenticated: the consumer's token with another's
	// signature. Its cluster names the line.
	parts := strings.Split(c.token, ".")
	forged := parts[0] + "." + parts[1] + "." + strings.Split(stranger.token, ".")[2]
	tokens = append(tokens, forged)
	forgedCluster := uniqueName(t, "forged")
	_, err = exchange(t, consumer{token: forged}, &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: forgedCluster}})
	require.Equal(t, codes.Unauthenticated, status.Code(err))
	wants = append(wants, wantExchange{what: "forged token", cluster: framework.FleetNamespace + "/" + forgedCluster, code: "Unauthenticated"})

	// The attack: a consumer asks for audiences that are segments of tokens
	// (its own hub token's, a spoke token's); the agent refuses each and
	// quotes it in its refusal, which the audit line records as the reason.
	for _, tok := range tokens[:2] {
		for i, seg := range strings.Split(tok, ".") {
			if seg == "" || len(seg) > 256 {
				continue // not an audience the broker lets through
			}
			_, err := exchange(t, c, &pb.ExchangeRequest{Cluster: clusterRef(spoke), ServiceAccount: sa, Audiences: []string{seg}})
			require.Equal(t, codes.PermissionDenied, status.Code(err), "segment %d: %v", i, err)
			wants = append(wants, wantExchange{what: "token segment as audience", user: c.username(),
				cluster: framework.FleetNamespace + "/" + spoke.Name, code: "PermissionDenied"})
		}
	}

	// An agent connects to every replica and disconnects.
	agentID := framework.AgentID(profile)
	stop, err := deployment.StartAgent(ctx, spoke, agentID)
	require.NoError(t, err)
	resp, err := exchange(t, c, &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: profile}, ServiceAccount: sa})
	require.NoError(t, err)
	tokens = append(tokens, resp.GetToken())
	wants = append(wants, wantExchange{what: "through the test's agent", user: c.username(), cluster: framework.FleetNamespace + "/" + profile,
		code: "OK", credentialID: resp.GetCredentialId()})
	stop()

	// An agent whose SPIFFE ID names no ClusterProfile is refused.
	unknownID := framework.AgentID(uniqueName(t, "no-such-profile"))
	stopUnknown, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{ID: unknownID, NoWait: true})
	require.NoError(t, err)
	waitAudit(t, "every replica to audit the refusal of an unknown agent", unknownID, func(l auditLine) bool {
		return l.str("msg") == "agent refused" && l.str("spiffeID") == unknownID
	})
	stopUnknown()

	// The disconnect lines are written as the streams end, which the
	// brokers see a moment after the agent stopped.
	waitAudit(t, "every replica to audit the agent's disconnect", agentID, func(l auditLine) bool {
		return l.str("msg") == "agent disconnected" && l.str("spiffeID") == agentID
	})

	lines, raw := readAudit(t)
	for _, w := range wants {
		n := countAudit(lines, func(l auditLine) bool {
			return l.str("msg") == "exchange" && l.str("user") == w.user && l.str("cluster") == w.cluster &&
				l.str("code") == w.code && l.str("credentialID") == w.credentialID
		})
		assert.GreaterOrEqual(t, n, 1, "no audit line of the exchange %q (user %q, cluster %s, code %s, credential %q)",
			w.what, w.user, w.cluster, w.code, w.credentialID)
	}
	connected := countAudit(lines, func(l auditLine) bool {
		return l.str("msg") == "agent connected" && l.str("spiffeID") == agentID &&
			l.str("cluster") == framework.FleetNamespace+"/"+profile && l.str("instance") != "" && l.str("code") == "OK"
	})
	assert.GreaterOrEqual(t, connected, len(deployment.Brokers), "every replica audits the agent's connect")
	refused := countAudit(lines, func(l auditLine) bool {
		return l.str("msg") == "agent refused" && l.str("spiffeID") == unknownID && l.str("code") == "PermissionDenied" && strings.Contains(l.str("reason"), "no ClusterProfile accepts agent")
	})
	assert.GreaterOrEqual(t, refused, len(deployment.Brokers), "the refusal names its code and reason")

	// No token, whole or any segment: this test's, and every spoke token
	// the suite received so far.
	// A whole token is in the log only if each of its segments is.
	minted.Lock()
	all := append(append([]string(nil), tokens...), minted.tokens...)
	minted.Unlock()
	inLog := newRunIndex(raw)
	for _, tok := range all {
		require.NotEmpty(t, tok)
		for i, seg := range strings.Split(tok, ".") {
			if seg != "" && inLog.contains(seg) {
				t.Errorf("segment %d of a token (%s...) is in the audit log", i, seg[:min(12, len(seg))])
			}
		}
	}
	assert.Empty(t, jwtSegment.FindAllString(raw, 5), "something shaped like a JWT segment is in the audit log")
	if t.Failed() {
		t.Logf("audit log:\n%s", raw)
	}
}

// runIndex answers whether a text contains a string of base64url
// characters, such as a JWT segment, without a scan of the text per
// question: such a string can only lie inside one maximal run of base64url
// characters of the text, so only the distinct runs at least as long as
// it are searched. A suite's audit log is tens of MiB, and the suite mints
// hundreds of tokens; a strings.Contains per segment took minutes under
// -race.
type runIndex struct {
	text string
	// runs are the text's distinct maximal runs, longest first.
	runs []string
}

func newRunIndex(text string) runIndex {
	seen := map[string]bool{}
	for _, run := range base64urlRun.FindAllString(text, -1) {
		seen[run] = true
	}
	idx := runIndex{text: text, runs: slices.Collect(maps.Keys(seen))}
	slices.SortFunc(idx.runs, func(a, b string) int { return len(b) - len(a) })
	return idx
}

var (
	base64urlRun  = regexp.MustCompile(`[A-Za-z0-9_-]+`)
	base64urlOnly = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)
)

func (idx runIndex) contains(s string) bool {
	if !base64urlOnly.MatchString(s) {
		return strings.Contains(idx.text, s)
	}
	for _, run := range idx.runs {
		if len(run) < len(s) {
			return false
		}
		if strings.Contains(run, s) {
			return true
		}
	}
	return false
}

func TestRunIndex(t *testing.T) {
	idx := newRunIndex(`{"msg":"exchange","hash":"a1b2c3d4e5","reason":"audience eyJhbGciOiJSUzI1NiJ9x is not allowed"} head.payload.sig`)
	for _, tc := range []struct {
		s    string
		want bool
	}{
		{"eyJhbGciOiJSUzI1NiJ9", true}, // inside a longer run
		{"b2c3d4", true},
		{"payload", true},
		{"head.payload", true}, // not base64url: the text itself is searched
		{"payloadsig", false},  // across a separator
		{"eyJhbGciOiJSUzI1NiJ9xy", false},
		{"absent", false},
	} {
		assert.Equal(t, tc.want, idx.contains(tc.s), tc.s)
	}
}
