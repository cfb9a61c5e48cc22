package apiproxy

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// PathPrefix starts the path of every ClusterProfile's API server on the
// proxy: /clusters/<namespace>/<name>/ and the spoke's own path after it.
const PathPrefix = "/clusters/"

// Grants finds the grant of a credential id while its token may be used;
// *grants.Registry is one.
type Grants interface {
	Live(credentialID string) (*pb.Grant, bool)
}

// Upstream is a ClusterProfile's API server as the proxy reaches it: the
// live incarnation, and how its serving certificate is verified.
type Upstream struct {
	Cluster    fleet.ClusterRef
	ServerName string
	CAData     []byte
}

// Upstreams resolves a ClusterProfile to its Upstream. Its errors wrap
// errdefs sentinels: ErrNotFound for no such ClusterProfile, ErrUnavailable
// when no agent carries its API server or the agents disagree on how to
// verify it.
type Upstreams interface {
	Upstream(cluster types.NamespacedName) (Upstream, error)
}

// Dialer opens a connection to a ClusterProfile's API server; *Router is
// one.
type Dialer interface {
	Dial(ctx context.Context, cluster fleet.ClusterRef) (net.Conn, error)
}

// The defaults of ProxyConfig.
const (
	DefaultMaxRequestsPerCluster  = 1000
	DefaultMaxRequestsPerConsumer = 100
	DefaultResponseHeaderTimeout  = time.Minute
)

// ProxyConfig configures a Proxy.
type ProxyConfig struct {
	Dialer    Dialer
	Grants    Grants
	Upstreams Upstreams
	// MaxRequestsPerCluster and MaxRequestsPerConsumer bound the requests
	// in flight (watches and upgraded connections included) to one
	// ClusterProfile, and of one hub consumer to one ClusterProfile.
	// Defaults DefaultMaxRequestsPerCluster (1000) and
	// DefaultMaxRequestsPerConsumer (100).
	MaxRequestsPerCluster, MaxRequestsPerConsumer int
	// ResponseHeaderTimeout bounds the wait for the spoke's answer to
	// start. Default DefaultResponseHeaderTimeout (60s).
	ResponseHeaderTimeout time.Duration
	// RecheckInterval is how often a request in flight checks that its
	// grant is still live, and ends when it is not. Default 500ms.
	RecheckInterval time.Duration
	// Audit gets one line per proxied request.
	Audit logr.Logger
	Clock clock.PassiveClock
	// Registerer takes the proxy's metrics; nil registers none.
	Registerer prometheus.Registerer
}

// Proxy is the broker's HTTP proxy to spoke API servers. It forwards a
// request only with a token that credbroker minted for that same
// ClusterProfile and that is still live; every other request gets 401 and
// is not forwarded. Build it with NewProxy.
type Proxy struct {
	cfg     ProxyConfig
	metrics *proxyMetrics

	mu         sync.Mutex
	transports map[upstreamKey]*http.Transport
	inFlight   map[string]int // by "cluster:" or "user:" key
}

type upstreamKey struct {
	cluster    fleet.ClusterRef
	serverName string
	ca         [sha256.Size]byte
}

// NewProxy returns a Proxy.
func NewProxy(cfg ProxyConfig) (*Proxy, error) {
	if cfg.Dialer == nil || cfg.Grants == nil || cfg.Upstreams == nil {
		return nil, errors.New("apiproxy: Dialer, Grants and Upstreams are required")
	}
	if cfg.MaxRequestsPerCluster <= 0 {
		cfg.MaxRequestsPerCluster = DefaultMaxRequestsPerCluster
	}
	if cfg.MaxRequestsPerConsumer <= 0 {
		cfg.MaxRequestsPerConsumer = DefaultMaxRequestsPerConsumer
	}
	if cfg.ResponseHeaderTimeout <= 0 {
		cfg.ResponseHeaderTimeout = DefaultResponseHeaderTimeout
	}
	if cfg.RecheckInterval <= 0 {
		cfg.RecheckInterval = 500 * time.Millisecond
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	m, err := newProxyMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	return &Proxy{cfg: cfg, metrics: m, transports: map[upstreamKey]*http.Transport{}, inFlight: map[string]int{}}, nil
}

// ParsePath splits a proxy path into its ClusterProfile and the spoke's
// path. It fails for a path outside PathPrefix or a ClusterProfile name
// that the API server would not accept.
func ParsePath(path string) (types.NamespacedName, string, error) {
	rest, ok := strings.CutPrefix(path, PathPrefix)
	if !ok {
		return types.NamespacedName{}, "", fmt.Errorf("the path %q is not under %s<namespace>/<name>/", clip(path), PathPrefix)
	}
	ns, rest, _ := strings.Cut(rest, "/")
	name, rest, _ := strings.Cut(rest, "/")
	if len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0 {
		return types.NamespacedName{}, "", fmt.Errorf("the path %q does not name a ClusterProfile as %s<namespace>/<name>/", clip(path), PathPrefix)
	}
	return types.NamespacedName{Namespace: ns, Name: name}, "/" + rest, nil
}

// URL returns the proxy's server URL of cluster, given the proxy's base
// URL (https://host:port, without a path).
func URL(base string, cluster types.NamespacedName) string {
	return strings.TrimSuffix(base, "/") + PathPrefix + cluster.Namespace + "/" + cluster.Name
}

// request is what ServeHTTP learns of one request as it checks it, for
// the forwarding and the audit line.
type request struct {
	cluster types.NamespacedName
	// path is the spoke's path of the request.
	path         string
	bearer       string
	credentialID string
	user         string // set once the token is authorized
	up           Upstream
}

// ServeHTTP forwards r to the spoke API server of the ClusterProfile its
// path names, or refuses it.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := p.cfg.Clock.Now()
	rw := &recorder{ResponseWriter: w}
	var (
		req request
		err error
		ctx context.Context
	)
	defer func() {
		if ctx != nil && err == nil {
			// A revoke, or the consumer leaving, ended the request.
			err = context.Cause(ctx)
		}
		p.done(rw, r, req.cluster, req.credentialID, req.user, err, p.cfg.Clock.Since(start))
	}()

	if err = p.check(r, &req); err != nil {
		writeStatus(rw, err)
		return
	}
	release, err := p.admit(req.cluster, req.user)
	if err != nil {
		writeStatus(rw, err)
		return
	}
	defer release()

	// The request lives while its grant does: a revoke ends it, watches and
	// upgraded connections included.
	var cancel context.CancelCauseFunc
	ctx, cancel = context.WithCancelCause(r.Context())
	defer cancel(nil)
	go p.watchGrant(ctx, cancel, req.credentialID)

	transport, err := p.transport(req.up)
	if err != nil {
		writeStatus(rw, err)
		return
	}
	rp := &httputil.ReverseProxy{
		Rewrite:       req.rewrite,
		Transport:     transport,
		FlushInterval: -1,
		ErrorLog:      nil,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, e error) {
			if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
				e = cause
			}
			err = fmt.Errorf("proxy to the API server of ClusterProfile %s: %v: %w", req.cluster, redactError(e, req.bearer), errdefs.ErrUnavailable)
			writeStatus(w, err)
		},
	}
	rp.ServeHTTP(rw, r.WithContext(ctx))
}

// check fills req from r, or returns why r is refused: its path must name
// a ClusterProfile, its bearer token must be a live token minted for it,
// and that ClusterProfile's incarnation must have an Upstream.
func (p *Proxy) check(r *http.Request, req *request) (err error) {
	if req.cluster, req.path, err = ParsePath(r.URL.Path); err != nil {
		return fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
	}
	bearer, ok := bearerOf(r)
	if !ok {
		return fmt.Errorf("no bearer token: send the spoke token that credbroker minted for ClusterProfile %s: %w", req.cluster, errdefs.ErrUnauthenticated)
	}
	req.bearer, req.credentialID = bearer, token.ID(bearer)
	grant, err := p.authorize(req.bearer, req.credentialID, req.cluster)
	if err != nil {
		return err
	}
	req.user = grant.GetSubject().GetUsername()
	if req.up, err = p.cfg.Upstreams.Upstream(req.cluster); err != nil {
		return err
	}
	if string(req.up.Cluster.UID) != grant.GetClusterUid() {
		return fmt.Errorf("the token was minted for an earlier ClusterProfile %s, deleted since: %w", req.cluster, errdefs.ErrUnauthenticated)
	}
	return nil
}

// rewrite sends the request to the spoke API server that req names.
func (req *request) rewrite(pr *httputil.ProxyRequest) {
	pr.Out.URL.Scheme, pr.Out.URL.Host = "https", req.up.ServerName
	pr.Out.URL.Path, pr.Out.URL.RawPath = req.path, ""
	pr.Out.Host = req.up.ServerName
	// The spoke authenticates the token that was checked here and no
	// other: a Connection header can name Authorization as hop-by-hop, and
	// a WebSocket subprotocol can carry a bearer.
	pr.Out.Header.Set("Authorization", "Bearer "+req.bearer)
	dropBearerProtocols(pr.Out.Header)
	// The spoke's audit log takes its source IPs from X-Forwarded-For, then
	// X-Real-Ip: both say the consumer's address, never what it claims.
	pr.Out.Header.Del("X-Real-Ip")
	pr.SetXForwarded()
}

// authorize returns the live grant of the bearer, which must be for
// cluster, or why the bearer is refused.
func (p *Proxy) authorize(bearer, credentialID string, cluster types.NamespacedName) (*pb.Grant, error) {
	// One answer whichever check fails: it tells nobody whether a
	// credential id is live, or for which ClusterProfile.
	refused := fmt.Errorf("the bearer token (%s) is not a live token that credbroker minted for ClusterProfile %s "+
		"(it was revoked, has expired, is for another ClusterProfile, or credbroker did not mint it); only such a token is forwarded: %w",
		credentialID, cluster, errdefs.ErrUnauthenticated)
	grant, ok := p.cfg.Grants.Live(credentialID)
	if !ok {
		return nil, refused
	}
	sum := sha256.Sum256([]byte(bearer))
	if subtle.ConstantTimeCompare(sum[:], grant.GetTokenSha256()) != 1 {
		return nil, refused
	}
	if got := grant.GetCluster(); got.GetNamespace() != cluster.Namespace || got.GetName() != cluster.Name {
		return nil, refused
	}
	return grant, nil
}

// watchGrant cancels ctx once credentialID's grant is no longer live.
func (p *Proxy) watchGrant(ctx context.Context, cancel context.CancelCauseFunc, credentialID string) {
	t := time.NewTicker(p.cfg.RecheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if _, ok := p.cfg.Grants.Live(credentialID); !ok {
				cancel(fmt.Errorf("the token's grant (%s) was revoked or expired: %w", credentialID, errdefs.ErrUnauthenticated))
				return
			}
		}
	}
}

// admit takes one request slot of cluster and of user, or fails with
// errdefs.ErrResourceExhausted; release gives them back.
func (p *Proxy) admit(cluster types.NamespacedName, user string) (release func(), err error) {
	ck, uk := "cluster:"+cluster.String(), "user:"+cluster.String()+":"+user
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.inFlight[ck] >= p.cfg.MaxRequestsPerCluster:
		return nil, fmt.Errorf("ClusterProfile %s has %d proxied requests in flight, the most the broker allows (--proxy-max-requests-per-cluster): %w",
			cluster, p.cfg.MaxRequestsPerCluster, errdefs.ErrResourceExhausted)
	case p.inFlight[uk] >= p.cfg.MaxRequestsPerConsumer:
		return nil, fmt.Errorf("%s has %d proxied requests in flight to ClusterProfile %s, the most the broker allows (--proxy-max-requests-per-consumer): %w",
			user, p.cfg.MaxRequestsPerConsumer, cluster, errdefs.ErrResourceExhausted)
	}
	p.inFlight[ck]++
	p.inFlight[uk]++
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, k := range []string{ck, uk} {
			if p.inFlight[k]--; p.inFlight[k] <= 0 {
				delete(p.inFlight, k)
			}
		}
	}, nil
}

// transport returns the HTTP transport to up, made once per incarnation,
// server name and CA.
func (p *Proxy) transport(up Upstream) (*http.Transport, error) {
	key := upstreamKey{cluster: up.Cluster, serverName: up.ServerName, ca: sha256.Sum256(up.CAData)}
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := p.transports[key]; ok {
		return t, nil
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(up.CAData) {
		return nil, fmt.Errorf("the agents of ClusterProfile %s offer no CA that verifies its API server: %w", up.Cluster, errdefs.ErrUnavailable)
	}
	// A transport of an older incarnation, name or CA is dropped.
	for k, t := range p.transports {
		if k.cluster.NamespacedName == up.Cluster.NamespacedName {
			t.CloseIdleConnections()
			delete(p.transports, k)
		}
	}
	cluster := up.Cluster
	t := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return p.cfg.Dialer.Dial(ctx, cluster)
		},
		TLSClientConfig:       &tls.Config{RootCAs: pool, ServerName: up.ServerName, MinVersion: tls.VersionTLS12},
		ForceAttemptHTTP2:     true,
		MaxIdleConnsPerHost:   32,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: p.cfg.ResponseHeaderTimeout,
	}
	p.transports[key] = t
	return t, nil
}
