package apiproxy

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
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

// ProxyConfig configures a Proxy.
type ProxyConfig struct {
	Dialer    Dialer
	Grants    Grants
	Upstreams Upstreams
	// MaxRequestsPerCluster and MaxRequestsPerConsumer bound the requests
	// in flight (watches and upgraded connections included) to one
	// ClusterProfile, and of one hub consumer to one ClusterProfile.
	// Defaults 1000 and 100.
	MaxRequestsPerCluster, MaxRequestsPerConsumer int
	// ResponseHeaderTimeout bounds the wait for the spoke's answer to
	// start. Default 60s.
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
		cfg.MaxRequestsPerCluster = 1000
	}
	if cfg.MaxRequestsPerConsumer <= 0 {
		cfg.MaxRequestsPerConsumer = 100
	}
	if cfg.ResponseHeaderTimeout <= 0 {
		cfg.ResponseHeaderTimeout = time.Minute
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

// ServeHTTP forwards r to the spoke API server of the ClusterProfile its
// path names, or refuses it.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := p.cfg.Clock.Now()
	rw := &recorder{ResponseWriter: w}
	var (
		cluster      types.NamespacedName
		credentialID string
		user         string // set once the token is authorized
		err          error
		ctx          context.Context
	)
	defer func() {
		if ctx != nil && err == nil {
			// A revoke, or the consumer leaving, ended the request.
			err = context.Cause(ctx)
		}
		p.done(rw, r, cluster, credentialID, user, err, p.cfg.Clock.Since(start))
	}()

	cluster, path, err := ParsePath(r.URL.Path)
	if err != nil {
		err = fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
		writeStatus(rw, err)
		return
	}
	bearer, ok := bearerOf(r)
	if !ok {
		err = fmt.Errorf("no bearer token: send the spoke token that credbroker minted for ClusterProfile %s: %w", cluster, errdefs.ErrUnauthenticated)
		writeStatus(rw, err)
		return
	}
	credentialID = token.ID(bearer)
	grant, err := p.authorize(bearer, credentialID, cluster)
	if err != nil {
		writeStatus(rw, err)
		return
	}
	user = grant.GetSubject().GetUsername()
	up, err := p.cfg.Upstreams.Upstream(cluster)
	if err == nil && string(up.Cluster.UID) != grant.GetClusterUid() {
		err = fmt.Errorf("the token was minted for an earlier ClusterProfile %s, deleted since: %w", cluster, errdefs.ErrUnauthenticated)
	}
	if err != nil {
		writeStatus(rw, err)
		return
	}
	release, err := p.admit(cluster, user)
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
	go p.watchGrant(ctx, cancel, credentialID)

	transport, err := p.transport(up)
	if err != nil {
		writeStatus(rw, err)
		return
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = "https", up.ServerName
			pr.Out.URL.Path, pr.Out.URL.RawPath = path, ""
			pr.Out.Host = up.ServerName
			// The spoke authenticates the token that was checked here and
			// no other: a Connection header can name Authorization as
			// hop-by-hop, and a WebSocket subprotocol can carry a bearer.
			pr.Out.Header.Set("Authorization", "Bearer "+bearer)
			dropBearerProtocols(pr.Out.Header)
		},
		Transport:     transport,
		FlushInterval: -1,
		ErrorLog:      nil,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, e error) {
			if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
				e = cause
			}
			err = fmt.Errorf("proxy to the API server of ClusterProfile %s: %v: %w", cluster, redactError(e, bearer), errdefs.ErrUnavailable)
			writeStatus(w, err)
		},
	}
	rp.ServeHTTP(rw, r.WithContext(ctx))
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

// done writes the request's audit line and metrics.
func (p *Proxy) done(rw *recorder, r *http.Request, cluster types.NamespacedName, credentialID, user string, err error, took time.Duration) {
	code := rw.code
	if code == 0 {
		code = http.StatusOK
	}
	// Only a ClusterProfile that a live token was authorized for labels
	// the metrics: anyone may send any path.
	label := ""
	if user != "" {
		label = cluster.String()
	}
	p.metrics.requests.WithLabelValues(label, strconv.Itoa(code)).Inc()
	p.metrics.bytes.WithLabelValues(label).Add(float64(rw.bytes))
	kv := []any{"credentialID", credentialID, "cluster", cluster.String(), "user", user, "verb", r.Method,
		"path", clip(r.URL.Path), "code", code, "bytes", rw.bytes, "durationSeconds", took.Seconds()}
	if err != nil {
		kv = append(kv, "reason", err.Error())
	}
	p.cfg.Audit.Info("apiproxy request", kv...)
}

// webSocketBearerPrefix starts a WebSocket subprotocol in which
// kube-apiserver accepts a bearer token (base64url-encoded).
const webSocketBearerPrefix = "base64url.bearer.authorization.k8s.io."

// dropBearerProtocols removes from h's Sec-WebSocket-Protocol the
// subprotocols that carry a bearer token.
func dropBearerProtocols(h http.Header) {
	values := h.Values("Sec-WebSocket-Protocol")
	if len(values) == 0 {
		return
	}
	var keep []string
	for _, v := range values {
		for p := range strings.SplitSeq(v, ",") {
			if p = strings.TrimSpace(p); p != "" && !strings.HasPrefix(p, webSocketBearerPrefix) {
				keep = append(keep, p)
			}
		}
	}
	h.Del("Sec-WebSocket-Protocol")
	if len(keep) > 0 {
		h.Set("Sec-WebSocket-Protocol", strings.Join(keep, ", "))
	}
}

// bearerOf returns the request's bearer token.
func bearerOf(r *http.Request) (string, bool) {
	v := r.Header.Values("Authorization")
	if len(v) != 1 {
		return "", false
	}
	scheme, tok, ok := strings.Cut(v[0], " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || tok == "" {
		return "", false
	}
	return strings.TrimSpace(tok), true
}

// writeStatus answers err as the Kubernetes API does, with a Status whose
// code and reason follow err's errdefs sentinel.
func writeStatus(w http.ResponseWriter, err error) {
	code, reason := http.StatusBadGateway, "ServiceUnavailable"
	switch {
	case errors.Is(err, errdefs.ErrUnauthenticated):
		code, reason = http.StatusUnauthorized, "Unauthorized"
	case errors.Is(err, errdefs.ErrNotFound):
		code, reason = http.StatusNotFound, "NotFound"
	case errors.Is(err, errdefs.ErrResourceExhausted):
		code, reason = http.StatusTooManyRequests, "TooManyRequests"
		w.Header().Set("Retry-After", "1")
	case errors.Is(err, errdefs.ErrUnavailable):
		code, reason = http.StatusServiceUnavailable, "ServiceUnavailable"
	}
	body, _ := json.Marshal(map[string]any{
		"kind": "Status", "apiVersion": "v1", "metadata": map[string]any{},
		"status": "Failure", "message": "credbroker: " + err.Error(), "reason": reason, "code": code,
	})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	_, _ = w.Write(body)
}

// redactError returns err's text without the bearer in it.
func redactError(err error, bearer string) string {
	return strings.ReplaceAll(err.Error(), bearer, "[redacted]")
}

func clip(s string) string {
	const max = 256
	if len(s) > max {
		return s[:max] + "…"
	}
	return s
}

// recorder counts what is written to a response; Unwrap gives
// http.ResponseController the writer beneath, to flush and to hijack.
type recorder struct {
	http.ResponseWriter
	code  int
	bytes int64
}

func (r *recorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(b []byte) (int, error) {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	n, err := r.ResponseWriter.Write(b)
	r.bytes += int64(n)
	return n, err
}

func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

type proxyMetrics struct {
	requests *prometheus.CounterVec
	bytes    *prometheus.CounterVec
}

func newProxyMetrics(reg prometheus.Registerer) (*proxyMetrics, error) {
	m := &proxyMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "credbroker_apiproxy_requests_total",
			Help: "Requests to the API proxy, by ClusterProfile (empty unless a live token of it was authorized) and HTTP code.",
		}, []string{"cluster", "code"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "credbroker_apiproxy_response_bytes_total",
			Help: "Response body bytes the API proxy wrote, by ClusterProfile.",
		}, []string{"cluster"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.requests, m.bytes} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("apiproxy: register metrics: %w", err)
			}
		}
	}
	return m, nil
}
