package client

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/internal/serverurl"
	"github.com/credbroker/credbroker/pkg/brokerclient"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// DefaultTimeout bounds one exchange when Config.Timeout is zero.
const DefaultTimeout = brokerclient.DefaultTimeout

// DefaultMaxRetryWait bounds, when Config.MaxRetryWait is zero, how long
// one token fetch waits in all as the broker's retry-after tells it.
const DefaultMaxRetryWait = 2 * time.Minute

// Reference names a namespaced object.
type Reference struct {
	Namespace, Name string
}

// String returns namespace/name.
func (r Reference) String() string { return r.Namespace + "/" + r.Name }

// Config configures a Client.
type Config struct {
	// Address is the broker's exchange address, host:port; required.
	Address string
	// TLS verifies the broker; required, and must not skip verification.
	// New clones it.
	TLS *tls.Config
	// TokenSource gives the hub token sent to the broker; required. Use
	// NewFileTokenSource for a projected ServiceAccount token.
	TokenSource TokenSource
	// ServiceAccount is the spoke ServiceAccount to ask for; when nil, the
	// spoke agent picks the single one that allows the caller.
	ServiceAccount *Reference
	// Audiences of the spoke tokens; empty means the spoke API server's
	// default audiences.
	Audiences []string
	// ExpirationSeconds is the requested lifetime; zero means the broker's
	// maximum.
	ExpirationSeconds int64
	// Timeout bounds one exchange; zero means DefaultTimeout.
	Timeout time.Duration
	// Clock decides when a spoke token is refreshed; nil means the real
	// clock.
	Clock clock.PassiveClock
	// UserAgent is sent to the broker; empty means "credbroker-client".
	UserAgent string
	// MaxRetryWait bounds how long one token fetch waits, in all, when the
	// broker refuses it with ResourceExhausted and a retry-after trailer
	// (its per-consumer rate limit): the fetch waits as told, plus up to a
	// fifth more so that refused callers do not all come back at once, and
	// asks again, while the wait fits in MaxRetryWait and the context.
	// Zero means DefaultMaxRetryWait; negative never waits.
	MaxRetryWait time.Duration
}

// Client gets spoke tokens from the broker for the ClusterProfiles its
// caller may use, and builds rest.Configs that carry them. It holds one
// connection to the broker and one token cache per ClusterProfile, shared
// by every rest.Config it returns. It is safe for concurrent use.
type Client struct {
	cfg  Config
	conn *grpc.ClientConn
	x    pb.TokenExchangeClient

	mu      sync.Mutex
	sources map[Reference]*spokeSource

	// sleep waits as the broker's retry-after tells; nil means a timer.
	// Tests replace it.
	sleep func(context.Context, time.Duration) error
}

// New validates cfg and returns a Client. It connects to the broker
// lazily, on the first exchange. Close the Client when done.
func New(cfg Config) (*Client, error) {
	creds, err := brokerclient.TLSCredentials(cfg.TLS)
	if err != nil {
		return nil, err
	}
	if cfg.TokenSource == nil {
		return nil, errors.New("token source is required")
	}
	if cfg.ServiceAccount != nil {
		if cfg.ServiceAccount.Namespace == "" || cfg.ServiceAccount.Name == "" {
			return nil, errors.New("service account needs a namespace and a name")
		}
		sa := *cfg.ServiceAccount
		cfg.ServiceAccount = &sa
	}
	req, err := brokerclient.Request{Audiences: cfg.Audiences, ExpirationSeconds: cfg.ExpirationSeconds, Timeout: cfg.Timeout}.Normalize()
	if err != nil {
		return nil, err
	}
	cfg.Audiences, cfg.Timeout = req.Audiences, req.Timeout
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.UserAgent == "" {
		cfg.UserAgent = "credbroker-client"
	}
	if cfg.MaxRetryWait == 0 {
		cfg.MaxRetryWait = DefaultMaxRetryWait
	}
	cfg.TLS = cfg.TLS.Clone()
	conn, err := brokerclient.Dial(cfg.Address, creds, cfg.UserAgent)
	if err != nil {
		return nil, err
	}
	return &Client{cfg: cfg, conn: conn, x: pb.NewTokenExchangeClient(conn), sources: map[Reference]*spokeSource{}}, nil
}

// Close closes the connection to the broker. rest.Configs built before
// fail to get new tokens afterwards.
func (c *Client) Close() error { return c.conn.Close() }

// RESTConfigFor returns a config for the spoke that the ClusterProfile
// namespace/name names: Host and CAData are the server and CA bundle the
// broker answers for it. The config holds no token. Its WrapTransport sets
// "Authorization: Bearer" on every request from the Client's token cache
// for the ClusterProfile, which every config and client built from it
// share: a token is used until half its lifetime has passed, then fetched
// anew; after a 401 from the spoke, it is dropped and the request is sent
// once more with a new one. A token is sent only to the server and CA it
// was answered with: should the broker later answer another server or CA
// for the ClusterProfile, requests through this config fail with an error
// wrapping errdefs.ErrPermissionDenied, and a new config is needed.
//
// RESTConfigFor gets a token at once, so an error tells what the caller
// cannot do now: its errdefs.Code is the broker's gRPC code. An answer
// without a server is refused with errdefs.ErrFailedPrecondition, and one
// whose server is not https, where the token would travel in cleartext,
// with errdefs.ErrPermissionDenied.
func (c *Client) RESTConfigFor(ctx context.Context, namespace, name string) (*rest.Config, error) {
	if namespace == "" || name == "" {
		return nil, fmt.Errorf("ClusterProfile needs a namespace and a name: %w", errdefs.ErrInvalidArgument)
	}
	src := c.source(Reference{Namespace: namespace, Name: name})
	t, err := src.token(ctx)
	if err != nil {
		return nil, err
	}
	pin := pin{server: t.server, ca: t.ca}
	cfg := &rest.Config{
		Host:            t.server,
		TLSClientConfig: rest.TLSClientConfig{CAData: bytes.Clone(t.ca)},
		UserAgent:       rest.DefaultKubernetesUserAgent(),
	}
	cfg.WrapTransport = func(rt httpRoundTripper) httpRoundTripper {
		return &roundTripper{src: src, pin: pin, next: rt}
	}
	return cfg, nil
}

// source returns the token cache of ref, creating it on first use.
func (c *Client) source(ref Reference) *spokeSource {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.sources[ref]
	if !ok {
		s = &spokeSource{c: c, ref: ref}
		c.sources[ref] = s
	}
	return s
}

// spokeToken is one answer of the broker.
type spokeToken struct {
	value        string
	server       string
	ca           []byte
	id           string
	fetched, exp time.Time
}

// usable reports whether t is before half its lifetime at now.
func (t *spokeToken) usable(now time.Time) bool {
	return t != nil && now.Before(t.fetched.Add(t.exp.Sub(t.fetched)/2))
}

// spokeSource is the token cache of one ClusterProfile: like
// oauth2.ReuseTokenSource, it hands out the token it holds while it is
// usable and fetches one otherwise, one fetch at a time.
type spokeSource struct {
	c   *Client
	ref Reference

	mu  sync.Mutex
	cur *spokeToken
}

func (s *spokeSource) token(ctx context.Context) (*spokeToken, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur.usable(s.c.cfg.Clock.Now()) {
		return s.cur, nil
	}
	t, err := s.c.exchange(ctx, s.ref)
	if err != nil {
		return nil, err
	}
	s.cur = t
	return t, nil
}

// invalidate drops the token with value v, if it is still the one held.
func (s *spokeSource) invalidate(v string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur != nil && s.cur.value == v {
		s.cur = nil
	}
}

// exchange asks the broker for a token for ref. When the broker's rate
// limit refuses it with a retry-after, it waits as told and asks again, for
// MaxRetryWait in all (brokerclient.WaitAndRetry).
func (c *Client) exchange(ctx context.Context, ref Reference) (*spokeToken, error) {
	return brokerclient.WaitAndRetry(ctx, c.cfg.MaxRetryWait, c.sleep, func() (*spokeToken, time.Duration, error) {
		return c.exchangeOnce(ctx, ref)
	})
}

// exchangeOnce asks the broker for a token for ref, once. A refusal by the
// broker's rate limit comes with the wait that its retry-after trailer
// tells.
func (c *Client) exchangeOnce(ctx context.Context, ref Reference) (*spokeToken, time.Duration, error) {
	hubToken, err := c.cfg.TokenSource.Token(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("exchange for cluster %s: hub token: %w", ref, err)
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	req := &pb.ExchangeRequest{
		Cluster:           &pb.ObjectReference{Namespace: ref.Namespace, Name: ref.Name},
		Audiences:         c.cfg.Audiences,
		ExpirationSeconds: c.cfg.ExpirationSeconds,
	}
	if sa := c.cfg.ServiceAccount; sa != nil {
		req.ServiceAccount = &pb.ObjectReference{Namespace: sa.Namespace, Name: sa.Name}
	}
	fetched := c.cfg.Clock.Now()
	var trailer metadata.MD
	resp, err := c.x.Exchange(ctx, req, grpc.PerRPCCredentials(brokerclient.Bearer(hubToken)), grpc.Trailer(&trailer))
	if err != nil {
		wait, _ := brokerclient.RetryAfter(err, trailer)
		st := status.Convert(err)
		msg := token.Redact(strings.ReplaceAll(st.Message(), hubToken, "[redacted]"))
		return nil, wait, fmt.Errorf("exchange for cluster %s: %s: %w", ref, st.Code(), errdefs.FromCode(st.Code(), msg))
	}
	t, err := answerToken(ref, resp, fetched)
	return t, 0, err
}

// answerToken checks the broker's answer and keeps what the cache needs.
func answerToken(ref Reference, resp *pb.ExchangeResponse, fetched time.Time) (*spokeToken, error) {
	switch {
	case resp.GetToken() == "":
		return nil, fmt.Errorf("exchange for cluster %s: broker returned no token", ref)
	case resp.GetServer() == "":
		return nil, fmt.Errorf("exchange for cluster %s: broker returned no server: the ClusterProfile lists no "+
			"access provider to reach the spoke: %w", ref, errdefs.ErrFailedPrecondition)
	case serverurl.Check(resp.GetServer()) != nil:
		return nil, unusableServer(ref, resp.GetServer())
	case resp.GetExpirationTime() == nil:
		return nil, fmt.Errorf("exchange for cluster %s: broker returned no expiration time", ref)
	}
	if err := resp.GetExpirationTime().CheckValid(); err != nil {
		return nil, fmt.Errorf("exchange for cluster %s: broker returned an invalid expiration time: %w", ref, err)
	}
	id := resp.GetCredentialId()
	if id == "" {
		id = token.Fingerprint(resp.GetToken())
	}
	return &spokeToken{
		value:   resp.GetToken(),
		server:  resp.GetServer(),
		ca:      bytes.Clone(resp.GetCertificateAuthorityData()),
		id:      id,
		fetched: fetched,
		exp:     resp.GetExpirationTime().AsTime(),
	}, nil
}

// unusableServer is the error for a broker answer whose server
// serverurl.Check refuses, naming the server without a password and why.
func unusableServer(ref Reference, server string) error {
	err := serverurl.Check(server)
	if errors.Is(err, serverurl.ErrNotHTTPS) {
		// client-go sends the bearer token whatever the scheme.
		return fmt.Errorf("exchange for cluster %s: refusing its token: its server %s is not an https URL, so the "+
			"token would travel in cleartext; its cluster manager must give the ClusterProfile an https server: %w",
			ref, serverurl.Redacted(server), errdefs.ErrPermissionDenied)
	}
	return fmt.Errorf("exchange for cluster %s: refusing its token: its server %s is not a usable API server URL: %v; "+
		"its cluster manager must give the ClusterProfile an https server with a host and without user information, "+
		"query or fragment: %w", ref, serverurl.Redacted(server), err, errdefs.ErrPermissionDenied)
}
