package e2e

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/credbroker/credbroker/pkg/identity"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// rogueCluster is the ClusterProfile that the fake agent serves.
const rogueCluster = "rogue"

// rogueAgent is a compromised agent: it holds a valid SVID for fleet/rogue,
// so the broker admits it, and answers every MintRequest with whatever its
// current answer function crafts. It talks the wire protocol by hand.
type rogueAgent struct {
	mu     sync.Mutex
	answer func(*pb.MintRequest) *pb.AgentFrame
	mints  atomic.Int32
}

func (a *rogueAgent) setAnswer(fn func(*pb.MintRequest) *pb.AgentFrame) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.answer = fn
}

func (a *rogueAgent) answerFor(req *pb.MintRequest) *pb.AgentFrame {
	a.mints.Add(1)
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.answer(req)
}

// startRogueAgent creates the ClusterProfile fleet/rogue and connects a fake
// agent with its SVID to every broker replica. The agent stops, and the
// brokers drop its streams, when the test ends.
func startRogueAgent(t *testing.T) *rogueAgent {
	t.Helper()
	ctx := context.Background()
	// It points at a real spoke, so that the exchange reaches the agent.
	if _, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, rogueCluster, deployment.ProfileAccess(env.Spokes[0], framework.FleetNamespace, rogueCluster)); err != nil && !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	certPEM, keyPEM, err := deployment.CA.IssueSVID(framework.AgentID(rogueCluster), time.Hour)
	require.NoError(t, err)
	svid, err := x509svid.Parse(certPEM, keyPEM)
	require.NoError(t, err)
	bundle, err := x509bundle.Parse(deployment.CA.TrustDomain(), deployment.CA.BundlePEM())
	require.NoError(t, err)
	creds := identity.ClientCredentials(svid, bundle, spiffeid.RequireFromPath(deployment.CA.TrustDomain(), "/broker"))

	agent := &rogueAgent{answer: honestAnswer}
	actx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		for _, b := range deployment.Brokers {
			require.EventuallyWithT(t, func(ct *assert.CollectT) {
				assert.Zero(ct, b.Connected(framework.FleetNamespace, rogueCluster), "agent streams of %s", rogueCluster)
			},
				10*time.Second, 20*time.Millisecond, "a broker still holds a stream of the fake agent")
		}
	})
	for _, b := range deployment.Brokers {
		conn, err := grpc.NewClient(b.AgentAddr(), grpc.WithTransportCredentials(creds))
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		client := pb.NewAgentTunnelClient(conn)
		// The brokers' informers may not know fleet/rogue yet: retry until
		// one stream is admitted.
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			stream, err := framework.AdmitFakeAgent(actx, client, "rogue")
			if !assert.NoError(ct, err, "admitting the fake agent at %s", b.AgentAddr()) {
				return
			}
			wg.Go(func() { agent.serve(stream) })
		}, 10*time.Second, 50*time.Millisecond, "the broker did not admit the fake agent")
		require.EventuallyWithT(t, func(ct *assert.CollectT) {
			assert.Equal(ct, 1, b.Connected(framework.FleetNamespace, rogueCluster), "agent streams of %s", rogueCluster)
		},
			10*time.Second, 20*time.Millisecond)
	}
	return agent
}

// serve answers mint requests until the stream ends.
func (a *rogueAgent) serve(stream grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame]) {
	for {
		f, err := stream.Recv()
		if err != nil {
			return
		}
		req := f.GetMintRequest()
		if req == nil {
			continue
		}
		out := a.answerFor(req)
		out.CorrelationId = f.GetCorrelationId()
		if err := stream.Send(out); err != nil {
			return
		}
	}
}

// craftToken builds a JWT-shaped token with the given payload and a random,
// unverifiable signature: the broker cannot check a spoke's signature, only
// what the token says.
func craftToken(claims map[string]any) string {
	enc := base64.RawURLEncoding.EncodeToString
	payload, _ := json.Marshal(claims)
	sig := make([]byte, 256)
	_, _ = rand.Read(sig)
	return enc([]byte(`{"alg":"RS256","kid":"rogue"}`)) + "." + enc(payload) + "." + enc(sig)
}

func randomJTI() string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// plausible is what an honest agent would answer to req: a token for the
// requested ServiceAccount (or rogue-ns/default), with the requested
// audiences, living the requested time.
type plausible struct {
	namespace, name string
	aud             []string
	exp             time.Time
	expirationTime  time.Time
	jti             string
}

func plausibleFor(req *pb.MintRequest) plausible {
	p := plausible{namespace: "rogue-ns", name: "default", aud: req.GetAudiences(), jti: randomJTI()}
	if sa := req.GetServiceAccount(); sa != nil {
		p.namespace, p.name = sa.GetNamespace(), sa.GetName()
	}
	if len(p.aud) == 0 {
		p.aud = []string{"https://kubernetes.default.svc"}
	}
	p.exp = time.Now().Add(time.Duration(req.GetExpirationSeconds()) * time.Second).Truncate(time.Second)
	p.expirationTime = p.exp
	return p
}

func (p plausible) frame(sub string) *pb.AgentFrame {
	now := time.Now().Unix()
	tok := craftToken(map[string]any{
		"iss": "https://rogue.example", "sub": sub, "aud": p.aud,
		"exp": p.exp.Unix(), "iat": now, "nbf": now, "jti": p.jti,
		"kubernetes.io": map[string]any{"namespace": p.namespace, "serviceaccount": map[string]any{"name": p.name, "uid": "0"}},
	})
	rogueTokens.Lock()
	rogueTokens.tokens = append(rogueTokens.tokens, tok)
	rogueTokens.Unlock()
	return &pb.AgentFrame{Body: &pb.AgentFrame_MintResponse{MintResponse: &pb.MintResponse{
		Token:          tok,
		ExpirationTime: timestamppb.New(p.expirationTime),
		ServiceAccount: &pb.ObjectReference{Namespace: p.namespace, Name: p.name},
	}}}
}

func (p plausible) sub() string { return "system:serviceaccount:" + p.namespace + ":" + p.name }

// rogueTokens are the tokens the fake agent sent, to check that none reaches
// a consumer's error or a log.
var rogueTokens struct {
	sync.Mutex
	tokens []string
}

func honestAnswer(req *pb.MintRequest) *pb.AgentFrame {
	p := plausibleFor(req)
	return p.frame(p.sub())
}

// Trust boundary: the broker checks what an agent answers. An agent holds a
// valid SVID for its ClusterProfile, but it may be compromised: whatever it
// says about the token it returns (ServiceAccount, audiences, expiry) is
// checked against the token's claims and the request before the broker
// caches, audits or returns it. Its error messages reach consumers without
// control characters or links.
func TestRogueAgent(t *testing.T) {
	agent := startRogueAgent(t)
	c := newConsumer(t, "credbroker", rogueCluster)
	cluster := &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: rogueCluster}
	request := func(name string, aud ...string) *pb.ExchangeRequest {
		return &pb.ExchangeRequest{Cluster: cluster, ServiceAccount: &pb.ObjectReference{Namespace: "rogue-ns", Name: name}, Audiences: aud}
	}

	t.Run("an honest answer is served, and audited from its claims", func(t *testing.T) {
		answered := make(chan plausible, 1)
		agent.setAnswer(func(req *pb.MintRequest) *pb.AgentFrame {
			p := plausibleFor(req)
			select {
			case answered <- p:
			default: // a second mint of the same request; the first is checked
			}
			return p.frame(p.sub())
		})
		resp, err := exchange(t, c, request("honest", "aud-honest"))
		require.NoError(t, err)
		p := <-answered
		assert.Equal(t, "honest", resp.GetServiceAccount().GetName())
		assert.Equal(t, p.exp.UTC(), resp.GetExpirationTime().AsTime())
		assert.Equal(t, "JTI="+p.jti, resp.GetCredentialId())
		line := logLine(t, `"credentialID"="JTI=`+p.jti+`"`)
		assert.Contains(t, line, `"serviceAccount"="rogue-ns/honest"`)
		assert.Contains(t, line, `"expiration"="`+p.exp.UTC().Format(time.RFC3339)+`"`)
	})

	tests := []struct {
		name      string
		req       *pb.ExchangeRequest
		answer    func(*pb.MintRequest) *pb.AgentFrame
		wantCheck string
	}{
		{
			name: "a token for another ServiceAccount than the answer names",
			req:  request("sub", "aud-sub"),
			answer: func(req *pb.MintRequest) *pb.AgentFrame {
				return plausibleFor(req).frame("system:serviceaccount:kube-system:cluster-admin")
			},
			wantCheck: "sub",
		},
		{
			name: "a year-long token",
			req:  request("year", "aud-year"),
			answer: func(req *pb.MintRequest) *pb.AgentFrame {
				p := plausibleFor(req)
				p.exp = time.Now().Add(365 * 24 * time.Hour).Truncate(time.Second)
				p.expirationTime = p.exp
				return p.frame(p.sub())
			},
			wantCheck: "exp",
		},
		{
			name: "an expiration_time that is not the token's exp",
			req:  &pb.ExchangeRequest{Cluster: cluster, ServiceAccount: &pb.ObjectReference{Namespace: "rogue-ns", Name: "exptime"}, ExpirationSeconds: 600},
			answer: func(req *pb.MintRequest) *pb.AgentFrame {
				p := plausibleFor(req)
				p.expirationTime = p.exp.Add(30 * time.Minute) // the cache would serve a dead token
				return p.frame(p.sub())
			},
			wantCheck: "expiration_time",
		},
		{
			name: "a token for other audiences",
			req:  request("aud", "aud-requested"),
			answer: func(req *pb.MintRequest) *pb.AgentFrame {
				p := plausibleFor(req)
				p.aud = []string{"sts.amazonaws.com"}
				return p.frame(p.sub())
			},
			wantCheck: "aud",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			agent.setAnswer(tt.answer)
			before := agent.mints.Load()
			_, err := exchange(t, c, tt.req)
			require.Equal(t, codes.Unavailable, status.Code(err), "the broker served the rogue answer: %v", err)
			msg := status.Convert(err).Message()
			assert.Contains(t, msg, "the agent of cluster fleet/rogue answered with a token that failed the broker's checks")
			assertNoRogueToken(t, msg)
			logLine(t, `"cluster"="fleet/rogue"`, `"check"="`+tt.wantCheck+`"`)

			// Nothing was cached: the same request asks the agent again.
			agent.setAnswer(honestAnswer)
			resp, err := exchange(t, c, tt.req)
			require.NoError(t, err)
			assert.Equal(t, tt.req.GetServiceAccount().GetName(), resp.GetServiceAccount().GetName())
			assert.Equal(t, before+2, agent.mints.Load())
		})
	}

	t.Run("an error message loses its control characters and links", func(t *testing.T) {
		agent.setAnswer(func(*pb.MintRequest) *pb.AgentFrame {
			return &pb.AgentFrame{Body: &pb.AgentFrame_Error{Error: &pb.Error{
				Code: int32(codes.PermissionDenied),
				Message: "no ServiceAccount allows you\n\nERROR: your credentials expired, sign in again at " +
					"https://login.evil.example/reset?u=x \x1b[31mnow\x1b[0m\r\x00\u202e\u2028done",
			}}}
		})
		_, err := exchange(t, c, request("error", "aud-error"))
		require.Equal(t, codes.PermissionDenied, status.Code(err), err)
		msg := status.Convert(err).Message()
		assert.Equal(t, "cluster fleet/rogue: agent: no ServiceAccount allows you ERROR: your credentials expired, sign in again at [link removed] [31mnow [0m done", msg)
		assert.False(t, strings.ContainsFunc(msg, func(r rune) bool {
			return unicode.In(r, unicode.Cc, unicode.Cf, unicode.Zl, unicode.Zp)
		}), "control characters reached the consumer: %q", msg)
		assert.NotContains(t, msg, "://")
		assert.NotContains(t, msg, "evil.example")
		assert.Contains(t, msg, "done")
	})

	t.Run("no rogue token reached a log", func(t *testing.T) {
		assertNoRogueToken(t, logs.String())
	})
}

func assertNoRogueToken(t *testing.T, s string) {
	t.Helper()
	rogueTokens.Lock()
	defer rogueTokens.Unlock()
	for _, tok := range rogueTokens.tokens {
		assert.False(t, strings.Contains(s, tok), "a token of the fake agent appears in %q", s[:min(len(s), 200)])
	}
}

// logLine returns the first line of the broker's logs that contains every
// want, or fails.
func logLine(t *testing.T, want ...string) string {
	t.Helper()
	var found string
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		log := logs.String()
	lines:
		for line := range strings.Lines(log) {
			for _, w := range want {
				if !strings.Contains(line, w) {
					continue lines
				}
			}
			found = line
			return
		}
		c.Errorf("no log line contains all of %q; the last lines:\n%s", want, framework.LastLines(log, 20))
	}, 5*time.Second, 20*time.Millisecond, "no log line contains %s", fmt.Sprint(want))
	return found
}
