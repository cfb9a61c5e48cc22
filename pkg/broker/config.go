package broker

import (
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"

	"github.com/credbroker/credbroker/internal/serverurl"
	"github.com/credbroker/credbroker/pkg/apiproxy"
	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/hubkeys"
	"github.com/credbroker/credbroker/pkg/identity"
	"github.com/credbroker/credbroker/pkg/token"
	"github.com/credbroker/credbroker/pkg/tokenexchange"
	"github.com/credbroker/credbroker/pkg/tunnel"
)

// Config is the broker's validated configuration.
type Config struct {
	// ExchangeAddress serves TokenExchange to consumers over TLS.
	ExchangeAddress string
	// AgentAddress serves AgentTunnel to agents over SPIFFE mTLS.
	AgentAddress string
	// MetricsAddress serves /metrics, /healthz and /readyz over HTTP; empty
	// disables it.
	MetricsAddress string

	// TLSCertFile and TLSKeyFile are the exchange port's serving certificate,
	// reloaded when they change.
	TLSCertFile, TLSKeyFile string
	// Config is the broker's SPIFFE identity: its X.509-SVID and the bundle
	// of TrustDomain, from files or the Workload API. A zero SPIFFEID means
	// spiffe://<TrustDomain>/broker (fleet.BrokerID).
	// FileCheckInterval is also how often the broker reads TLSCertFile,
	// TLSKeyFile and IssuerJWKSFile again.
	identity.Config

	// Hub is the hub API server's client config. Its QPS and Burst are
	// raised to HubQPS and HubBurst: every exchange that misses the
	// decision caches costs a TokenReview and a SubjectAccessReview.
	Hub              *rest.Config
	HubQPS           float32
	HubBurst         int
	InformerResync   time.Duration
	CacheSyncTimeout time.Duration
	// ShutdownGrace bounds the drain when Run's context ends: the broker
	// turns not ready, tells its agents, refuses new calls and streams,
	// finishes the exchanges in flight (and their mints), then closes the
	// agent streams. ShutdownDelay, within it, is how long the broker keeps
	// serving new calls after it turns not ready, for the Service's
	// endpoints to drop it first.
	ShutdownGrace, ShutdownDelay time.Duration
	// AgentReconnectWindow is how long a starting replica waits, at most,
	// for the agents to find it before it reports ready: agents resolve
	// the broker's headless Service every 30s. It is ready sooner once
	// every ClusterProfile that the publishing replica reports connected
	// has a stream here. Zero: ready without waiting.
	AgentReconnectWindow time.Duration
	// Clock times readiness. Default: the real clock.
	Clock clock.PassiveClock
	// MaxStreamsPerCluster bounds the agent streams one ClusterProfile may
	// hold to this replica (one per agent: a DaemonSet's agents need one per
	// node). MaxConcurrentStreams bounds the concurrent calls (HTTP/2
	// streams) of one connection, on both ports.
	MaxStreamsPerCluster int
	MaxConcurrentStreams uint32
	// MaxGrantBytesPerCluster bounds what this replica holds of the grants
	// one ClusterProfile's agents report (grants.RegistryConfig): a report
	// past it closes the agent's stream with ResourceExhausted.
	MaxGrantBytesPerCluster int
	// Profiling serves net/http/pprof under /debug/pprof/ on the metrics
	// listener (MetricsAddress). Off by default: a profile shows timings
	// and allocation sites, no secret, but it costs CPU while it runs.
	Profiling bool

	// PendingRevokesNamespace holds the ConfigMap
	// grants.DefaultPendingConfigMap, where the replicas record the revokes
	// that no agent confirmed, for every replica to send again: the
	// broker's own namespace.
	PendingRevokesNamespace string

	// Audience a consumer's hub token must carry.
	Audience string
	// MaxExpiration caps minted tokens' lifetime.
	MaxExpiration time.Duration
	// MintTimeout bounds the wait for an agent's answer.
	MintTimeout time.Duration
	// AgentReturnWait is how long a mint waits, within MintTimeout, for
	// an agent of its cluster when the cluster's last agent stream ended
	// less than this long ago (tunnel.ServerConfig.ReturnWait). Zero:
	// refuse at once.
	AgentReturnWait time.Duration
	// AgentMaxConnectionAge ends an agent's connection after about this
	// long (gRPC adds ±10% jitter), so that every handshake is made again
	// with current SVIDs and bundle; the agent reconnects.
	// AgentMaxConnectionAgeGrace then lets mints in flight finish.
	AgentMaxConnectionAge, AgentMaxConnectionAgeGrace time.Duration
	// AgentKeepaliveTime is how long an agent connection may be silent
	// before the broker pings it, and AgentKeepaliveTimeout how long the
	// broker then waits for the answer before it closes the connection.
	// Their sum bounds how long a partition without a TCP reset goes
	// unnoticed; keep it under MintTimeout, so that the mints in flight on
	// a partitioned stream move to another of the cluster's streams.
	AgentKeepaliveTime, AgentKeepaliveTimeout time.Duration
	// AccessProviderName is the ClusterProfile access provider whose server
	// and CA are returned to consumers; others are used when it is absent.
	AccessProviderName string
	// AuthnTTL, AllowTTL and DenyTTL bound the decision caches.
	AuthnTTL, AllowTTL, DenyTTL time.Duration
	// RateLimit and RateBurst limit, per consumer, the mints and hub reviews
	// its exchanges cause; answers from the caches do not count. The
	// default burst (2000) lets a consumer start with 1,000 ClusterProfiles,
	// a SubjectAccessReview and a mint each, without waiting.
	RateLimit float64
	RateBurst int
	// ReviewRateLimit and ReviewBurst limit TokenReviews of new tokens, for
	// all callers together.
	ReviewRateLimit float64
	ReviewBurst     int
	// PeerReviewRateLimit and PeerReviewBurst limit TokenReviews of new
	// tokens from one peer address (IP).
	PeerReviewRateLimit float64
	PeerReviewBurst     int
	// NamespaceReviewRateLimit and NamespaceReviewBurst limit TokenReviews
	// of new tokens of one hub namespace, from any address (see
	// tokenexchange.Config).
	NamespaceReviewRateLimit float64
	NamespaceReviewBurst     int
	// IssuerJWKSFile, when set, is a JSON Web Key Set file of the hub's
	// service-account issuer, read every FileCheckInterval, instead of the
	// hub's /openid/v1/jwks. Tokens are verified against these keys before
	// any TokenReview.
	IssuerJWKSFile string
	// IssuerKeysRefresh is how often the issuer's keys are fetched from the
	// hub; IssuerKeysMinRefresh is the least time between two fetches, which
	// a token naming an unknown key id also triggers.
	IssuerKeysRefresh, IssuerKeysMinRefresh time.Duration

	// GrantRecheckInterval is the period of the sweep that checks every
	// live grant against hub RBAC, its ClusterProfile and its consumer's hub
	// ServiceAccount. RBACDebounce is the quiet time after a hub RBAC change
	// before the live grants are checked again, and RBACDebounceMax the
	// longest wait from the first change of a burst.
	GrantRecheckInterval, RBACDebounce, RBACDebounceMax time.Duration
	// GrantReviewRateLimit and GrantReviewBurst limit the
	// SubjectAccessReviews of those checks (one per consumer and
	// ClusterProfile with live grants).
	GrantReviewRateLimit float64
	GrantReviewBurst     int

	// EnableReflection registers gRPC server reflection on the exchange
	// port, for debugging with grpcurl and the like. Off by default: the
	// port faces every consumer.
	EnableReflection bool

	// PublishAccessProvider makes the replica that holds the Lease
	// PublishLeaseNamespace/PublishLeaseName keep the AccessProviderName
	// entry and the CredentialBrokerConnected condition in the status of
	// every ClusterProfile with a connected agent (package publish).
	// PublishIdentity names this replica in the Leases, the publisher's
	// and the triggers' (default: a random name). PublishDisconnectGrace is how long a ClusterProfile has no
	// agent before its condition turns False.
	PublishAccessProvider                   bool
	PublishLeaseNamespace, PublishLeaseName string
	PublishIdentity                         string
	PublishDisconnectGrace                  time.Duration
	// PublishControlPlaneHealthy makes the publisher keep the
	// ControlPlaneHealthy condition too, from the agents' reports of their
	// spoke's /readyz, where no other field manager owns it. It needs
	// PublishAccessProvider.
	PublishControlPlaneHealthy bool
	// TriggerLeaseName is the Lease, in PendingRevokesNamespace, that
	// picks the one replica that runs the revocation triggers (their
	// SubjectAccessReviews are the same on every replica); its holder
	// checks every live grant when it takes over. PublishIdentity names
	// this replica in it too. Empty: this replica runs them, with no
	// Lease, as a single replica that may not write Leases must.
	TriggerLeaseName string

	// ProxyAddress, when set, serves the API proxy over TLS (with the
	// exchange port's certificate): the spoke API servers that agents carry
	// over their data path streams, under /clusters/<namespace>/<name>/,
	// for tokens that credbroker minted (package apiproxy). ProxyURL is its
	// https base URL as consumers reach it, and ProxyCAData the PEM bundle
	// that verifies it there: the publisher writes them, with the path of
	// the ClusterProfile, into the status of a ClusterProfile whose agents
	// carry its API server and advertise no server of their own.
	ProxyAddress string
	ProxyURL     string
	ProxyCAData  []byte
	// ProxyMaxRequestsPerCluster and ProxyMaxRequestsPerConsumer bound the
	// proxied requests in flight to one ClusterProfile and of one hub
	// consumer to one ClusterProfile; ProxyResponseHeaderTimeout bounds
	// the wait for a spoke's answer to start, and ProxyIdleTimeout how long
	// a consumer's idle keep-alive connection stays open.
	ProxyMaxRequestsPerCluster, ProxyMaxRequestsPerConsumer int
	ProxyResponseHeaderTimeout, ProxyIdleTimeout            time.Duration

	// Log receives operational logs; Audit receives one line per exchange,
	// per Grants call, and per agent stream connected, disconnected or
	// refused (the broker binary writes it to --audit-log-path as JSON
	// lines).
	Log, Audit logr.Logger
	// AuditLog, when set, receives the exchanges' audit lines in place of
	// Audit, as JSON lines that the exchange encodes itself
	// (tokenexchange.Config.AuditLog); it must be safe for concurrent
	// Writes. The broker binary passes the writer of --audit-log-path
	// beneath Audit.
	AuditLog io.Writer
}

// Default returns a Config with every default set and nothing that must be
// chosen per installation (files, hub config, trust domain).
func Default() Config {
	return Config{
		Config:                      identity.DefaultConfig(),
		ExchangeAddress:             ":8443",
		AgentAddress:                ":8444",
		MetricsAddress:              ":8080",
		HubQPS:                      200,
		HubBurst:                    400,
		InformerResync:              10 * time.Minute,
		CacheSyncTimeout:            time.Minute,
		ShutdownGrace:               15 * time.Second,
		AgentReconnectWindow:        45 * time.Second,
		MaxStreamsPerCluster:        tunnel.DefaultMaxStreamsPerCluster,
		MaxConcurrentStreams:        1000,
		MaxGrantBytesPerCluster:     grants.DefaultMaxGrantBytesPerCluster,
		Audience:                    tokenexchange.DefaultAudience,
		PendingRevokesNamespace:     "credbroker-system",
		MaxExpiration:               tokenexchange.DefaultMaxExpiration,
		MintTimeout:                 tunnel.DefaultMintTimeout,
		AgentReturnWait:             tunnel.DefaultReturnWait,
		AgentMaxConnectionAge:       time.Hour,
		AgentMaxConnectionAgeGrace:  30 * time.Second,
		AgentKeepaliveTime:          5 * time.Second,
		AgentKeepaliveTimeout:       3 * time.Second,
		AccessProviderName:          "credbroker",
		AuthnTTL:                    tokenexchange.DefaultAuthnTTL,
		AllowTTL:                    tokenexchange.DefaultAllowTTL,
		DenyTTL:                     tokenexchange.DefaultDenyTTL,
		RateLimit:                   tokenexchange.DefaultRateLimit,
		RateBurst:                   tokenexchange.DefaultRateBurst,
		ReviewRateLimit:             tokenexchange.DefaultReviewRateLimit,
		ReviewBurst:                 tokenexchange.DefaultReviewBurst,
		PeerReviewRateLimit:         tokenexchange.DefaultPeerReviewRateLimit,
		PeerReviewBurst:             tokenexchange.DefaultPeerReviewBurst,
		NamespaceReviewRateLimit:    tokenexchange.DefaultNamespaceReviewRateLimit,
		NamespaceReviewBurst:        tokenexchange.DefaultNamespaceReviewBurst,
		IssuerKeysRefresh:           hubkeys.DefaultRefreshInterval,
		IssuerKeysMinRefresh:        hubkeys.DefaultMinRefreshInterval,
		GrantRecheckInterval:        grants.DefaultTriggerInterval,
		RBACDebounce:                grants.DefaultTriggerDebounce,
		RBACDebounceMax:             grants.DefaultTriggerMaxDelay,
		GrantReviewRateLimit:        grants.DefaultTriggerReviewRate,
		GrantReviewBurst:            grants.DefaultTriggerReviewBurst,
		PublishLeaseName:            "credbroker-publisher",
		TriggerLeaseName:            "credbroker-triggers",
		PublishDisconnectGrace:      30 * time.Second,
		ProxyMaxRequestsPerCluster:  apiproxy.DefaultMaxRequestsPerCluster,
		ProxyMaxRequestsPerConsumer: apiproxy.DefaultMaxRequestsPerConsumer,
		ProxyResponseHeaderTimeout:  apiproxy.DefaultResponseHeaderTimeout,
		ProxyIdleTimeout:            90 * time.Second,
	}
}

// Validate reports every missing or inconsistent field at once.
func (c *Config) Validate() error {
	var errs []error
	need := func(ok bool, format string, args ...any) {
		if !ok {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	need(c.ExchangeAddress != "", "the exchange address is required")
	need(c.AgentAddress != "", "the agent address is required")
	need(c.TLSCertFile != "" && c.TLSKeyFile != "", "a TLS certificate and key for the exchange port are required")
	errs = append(errs, c.Config.Validate("broker"))
	need(c.Hub != nil, "a hub client config is required")
	// A rate of +Inf would switch its limiter off; NaN fails > 0.
	finite := func(f float64) bool { return f > 0 && !math.IsInf(f, 1) }
	need(finite(float64(c.HubQPS)) && c.HubBurst > 0, "hub QPS and burst must be positive and finite")
	need(c.Audience != "", "the audience is required")
	need(len(validation.IsDNS1123Label(c.PendingRevokesNamespace)) == 0,
		"the namespace of the pending revokes must be a namespace name (the broker's own), got %q", c.PendingRevokesNamespace)
	need(c.MaxExpiration >= token.MinExpiration, "the maximum expiration must be at least 10m (TokenRequest's floor), got %s", c.MaxExpiration)
	need(c.MintTimeout > 0, "the mint timeout must be positive")
	need(c.AgentReturnWait >= 0 && c.AgentReturnWait < c.MintTimeout,
		"the agent return wait (%s) must be at least 0 and under the mint timeout (%s), which bounds it and the mint after it", c.AgentReturnWait, c.MintTimeout)
	need(c.AgentReconnectWindow >= 0, "the agent reconnect window must not be negative")
	need(c.ShutdownGrace > 0 && c.ShutdownDelay >= 0 && c.ShutdownDelay < c.ShutdownGrace,
		"the shutdown grace must be positive, and the shutdown delay less than it (%s, %s)", c.ShutdownGrace, c.ShutdownDelay)
	need(c.MaxStreamsPerCluster > 0, "the agent streams per cluster must be positive")
	need(c.MaxConcurrentStreams > 0, "the concurrent streams per connection must be positive")
	need(c.MaxGrantBytesPerCluster >= grants.DefaultMaxGrantBytes,
		"the grant bytes per cluster must be at least %d, the largest grant an agent reports, got %d", grants.DefaultMaxGrantBytes, c.MaxGrantBytesPerCluster)
	need(c.AgentMaxConnectionAge > 0, "the agent connection age must be positive")
	need(c.AgentKeepaliveTime >= time.Second && c.AgentKeepaliveTimeout >= time.Second,
		"the agent keepalive time (%s) and timeout (%s) must be at least 1s", c.AgentKeepaliveTime, c.AgentKeepaliveTimeout)
	need(c.AgentKeepaliveTime+c.AgentKeepaliveTimeout < c.MintTimeout,
		"the agent keepalive time and timeout (%s + %s) must add up to less than the mint timeout (%s), so that a partitioned agent's stream closes before the mints on it time out",
		c.AgentKeepaliveTime, c.AgentKeepaliveTimeout, c.MintTimeout)
	need(c.AgentMaxConnectionAgeGrace >= c.MintTimeout, "the agent connection age grace (%s) must be at least the mint timeout (%s), so that mints in flight finish",
		c.AgentMaxConnectionAgeGrace, c.MintTimeout)
	need(c.DenyTTL <= c.AllowTTL, "denials must not be cached longer than approvals (%s > %s)", c.DenyTTL, c.AllowTTL)
	need(finite(c.RateLimit) && c.RateBurst > 0, "the rate limit and burst must be positive and finite")
	need(finite(c.ReviewRateLimit) && c.ReviewBurst > 0, "the review rate limit and burst must be positive and finite")
	need(finite(c.PeerReviewRateLimit) && c.PeerReviewBurst > 0, "the per-peer review rate limit and burst must be positive and finite")
	need(finite(c.NamespaceReviewRateLimit) && c.NamespaceReviewBurst > 0, "the per-namespace review rate limit and burst must be positive and finite")
	need(c.IssuerKeysMinRefresh > 0 && c.IssuerKeysMinRefresh <= c.IssuerKeysRefresh,
		"the issuer keys' minimum refresh interval must be positive and at most their refresh interval (%s, %s)", c.IssuerKeysMinRefresh, c.IssuerKeysRefresh)
	need(c.TriggerLeaseName == "" || len(validation.IsDNS1123Subdomain(c.TriggerLeaseName)) == 0,
		"the triggers' Lease name must be an object name, got %q", c.TriggerLeaseName)
	need(c.GrantRecheckInterval > 0, "the grant recheck interval must be positive")
	need(c.RBACDebounce > 0 && c.RBACDebounceMax >= c.RBACDebounce,
		"the RBAC debounce must be positive and at most its maximum (%s, %s)", c.RBACDebounce, c.RBACDebounceMax)
	need(finite(c.GrantReviewRateLimit) && c.GrantReviewBurst > 0, "the grant review rate limit and burst must be positive and finite")
	if c.ProxyAddress != "" {
		need(c.ProxyMaxRequestsPerCluster > 0 && c.ProxyMaxRequestsPerConsumer > 0, "the proxy's request limits must be positive")
		need(c.ProxyResponseHeaderTimeout > 0 && c.ProxyIdleTimeout > 0, "the proxy's timeouts must be positive")
	}
	if c.ProxyURL != "" {
		need(c.ProxyAddress != "", "a proxy URL needs the proxy address it is served on")
		if err := serverurl.Check(c.ProxyURL); err != nil {
			errs = append(errs, fmt.Errorf("the proxy URL: %w", err))
		}
		need(len(c.ProxyCAData) > 0, "a proxy URL needs the CA that verifies it")
	}
	if c.PublishAccessProvider {
		need(c.PublishLeaseNamespace != "" && c.PublishLeaseName != "", "publishing the access provider needs the namespace and name of its Lease")
		need(c.AccessProviderName != "", "publishing the access provider needs its name")
		need(c.PublishDisconnectGrace >= 0, "the publish disconnect grace must not be negative")
	}
	need(!c.PublishControlPlaneHealthy || c.PublishAccessProvider, "keeping ControlPlaneHealthy needs --publish-access-provider: the replica that publishes keeps it")
	return errors.Join(errs...)
}
