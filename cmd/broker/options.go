package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/pflag"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/broker"
)

const usage = `Usage: broker --trust-domain TD --tls-cert-file F --tls-key-file F (--svid-cert-file F --svid-key-file F --trust-bundle-file F | --spiffe-endpoint-socket S) [flags]

The hub side of credbroker: TokenExchange and Grants for consumers, and
AgentTunnel for spoke agents. Operational logs go to standard error, audit
lines to --audit-log-path.`

// options are the broker's flags that parseFlags turns into broker.Config
// fields once they are parsed.
type options struct {
	kubeconfig, proxyCA string
	identity            cmdflags.IdentityFlags
	audit               cmdflags.AuditFlags
}

// parseFlags turns the command line into a validated broker.Config, whose
// Audit logger writes to the returned audit log; the caller closes it on
// exit. It returns cmdflags.ErrVersion for --version and an error wrapping
// pflag.ErrHelp for --help.
func parseFlags(args []string) (broker.Config, io.Closer, error) {
	cfg := broker.Default()
	var o options
	fs, common := cmdflags.New("broker", usage)
	addListenerFlags(fs, &cfg, &o)
	addExchangeFlags(fs, &cfg)
	addPublishFlags(fs, &cfg)
	addCheckFlags(fs, &cfg)
	addCapacityFlags(fs, &cfg)
	addProxyFlags(fs, &cfg, &o)
	o.audit.AddFlags(fs)
	common.AddLogFlags()
	if err := common.Parse(args); err != nil {
		return cfg, nil, err
	}

	cfg.Log = common.Logger(os.Stderr).WithName("broker")
	if err := o.complete(&cfg); err != nil {
		return cfg, nil, err
	}
	if err := cfg.Validate(); err != nil {
		return cfg, nil, err
	}
	// Opened last: nothing above can fail and leave the file open.
	sink, err := o.audit.Open()
	if err != nil {
		return cfg, nil, err
	}
	cfg.Audit, cfg.AuditLog = cmdflags.AuditLogger(sink), sink
	return cfg, sink, nil
}

// complete sets the fields of cfg that the parsed options o stand for.
func (o *options) complete(cfg *broker.Config) (err error) {
	if err := o.identity.Apply(); err != nil {
		return err
	}
	if o.proxyCA != "" {
		if cfg.ProxyCAData, err = os.ReadFile(o.proxyCA); err != nil {
			return fmt.Errorf("--proxy-ca-file: %w", err)
		}
	}
	if cfg.PendingRevokesNamespace == "" {
		cfg.PendingRevokesNamespace = ownNamespace()
	}
	if cfg.Hub, err = clientcmd.BuildConfigFromFlags("", o.kubeconfig); err != nil {
		return fmt.Errorf("hub config: %w", err)
	}
	return nil
}

// addListenerFlags adds the flags of the broker's listeners, its
// certificates and SPIFFE identity, and the hub it serves.
func addListenerFlags(fs *pflag.FlagSet, cfg *broker.Config, o *options) {
	fs.StringVar(&cfg.ExchangeAddress, "exchange-address", cfg.ExchangeAddress, "address of the TokenExchange gRPC server (TLS) for consumers")
	fs.StringVar(&cfg.AgentAddress, "agent-address", cfg.AgentAddress, "address of the AgentTunnel gRPC server (SPIFFE mTLS) for spoke agents")
	fs.StringVar(&cfg.MetricsAddress, "metrics-address", cfg.MetricsAddress, "address of /metrics, /healthz and /readyz; empty disables them")
	fs.StringVar(&cfg.TLSCertFile, "tls-cert-file", "", "PEM serving certificate of the exchange port; reloaded on change (required)")
	fs.StringVar(&cfg.TLSKeyFile, "tls-key-file", "", "PEM key of --tls-cert-file (required)")
	o.identity = cmdflags.IdentityFlags{
		Whose:                "broker",
		SVIDCertFileUsage:    "PEM X.509-SVID of the broker, leaf first; reloaded on change (this or --spiffe-endpoint-socket)",
		TrustBundleFileUsage: "PEM CA certificates of the trust domain that agents' SVIDs chain to; with --svid-cert-file",
		SPIFFEIDUsage:        "the broker's own SPIFFE ID, which the Workload API's SVID must have (default spiffe://<trust-domain>/broker)",
		TrustDomainUsage:     "SPIFFE trust domain of the broker and the agents, e.g. fleet.example (required)",
	}
	o.identity.AddFlags(fs, &cfg.Config)
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig of the hub; empty means the in-cluster config")
}

// addExchangeFlags adds the flags of the exchanges: the hub client, the
// tokens minted, the agent connections that carry the mints, and the
// decision caches and rate limits.
func addExchangeFlags(fs *pflag.FlagSet, cfg *broker.Config) {
	fs.Var(cmdflags.Float32(&cfg.HubQPS), "hub-qps", "QPS of the hub client")
	fs.IntVar(&cfg.HubBurst, "hub-burst", cfg.HubBurst, "burst of the hub client")
	fs.StringVar(&cfg.Audience, "audience", cfg.Audience, "audience that consumers' hub tokens must carry")
	fs.StringVar(&cfg.PendingRevokesNamespace, "pending-revokes-namespace", "", "namespace of the ConfigMap credbroker-pending-revokes, where the replicas record the revokes no agent confirmed yet, for every replica to send again (default: the broker's own namespace in a pod, else credbroker-system)")
	fs.DurationVar(&cfg.MaxExpiration, "max-expiration", cfg.MaxExpiration, "longest lifetime of a minted spoke token (at least 10m)")
	fs.DurationVar(&cfg.MintTimeout, "mint-timeout", cfg.MintTimeout, "how long to wait for an agent's answer")
	fs.DurationVar(&cfg.AgentMaxConnectionAge, "agent-max-connection-age", cfg.AgentMaxConnectionAge, "renew each agent connection after about this long, so that handshakes use current SVIDs and bundle")
	fs.DurationVar(&cfg.AgentMaxConnectionAgeGrace, "agent-max-connection-age-grace", cfg.AgentMaxConnectionAgeGrace, "how long a renewed agent connection may finish its mints (at least --mint-timeout)")
	fs.DurationVar(&cfg.AgentKeepaliveTime, "agent-keepalive-time", cfg.AgentKeepaliveTime, "ping an agent after its connection has been silent this long")
	fs.DurationVar(&cfg.AgentKeepaliveTimeout, "agent-keepalive-timeout", cfg.AgentKeepaliveTimeout, "close an agent connection whose ping is not answered in this long; with --agent-keepalive-time, bounds how long a silent partition goes unnoticed (the sum must stay under --mint-timeout)")
	fs.StringVar(&cfg.AccessProviderName, "access-provider", cfg.AccessProviderName, "ClusterProfile access provider whose server and CA are returned to consumers")
	fs.DurationVar(&cfg.AuthnTTL, "authn-cache-ttl", cfg.AuthnTTL, "how long a successful TokenReview is reused (never past the token's expiry)")
	fs.DurationVar(&cfg.AllowTTL, "authz-allow-ttl", cfg.AllowTTL, "how long an allowed SubjectAccessReview is reused")
	fs.DurationVar(&cfg.DenyTTL, "authz-deny-ttl", cfg.DenyTTL, "how long a denied SubjectAccessReview or failed TokenReview is reused")
	fs.Float64Var(&cfg.RateLimit, "rate-limit", cfg.RateLimit, "mints and hub reviews per second allowed per consumer (answers from the cache are free)")
	fs.IntVar(&cfg.RateBurst, "rate-burst", cfg.RateBurst, "burst of mints and hub reviews allowed per consumer: a consumer's start with N ClusterProfiles costs 2N (a SubjectAccessReview and a mint each)")
	fs.Float64Var(&cfg.ReviewRateLimit, "review-rate-limit", cfg.ReviewRateLimit, "TokenReviews per second of tokens not in the cache, all callers together")
	fs.IntVar(&cfg.ReviewBurst, "review-burst", cfg.ReviewBurst, "burst of TokenReviews of tokens not in the cache")
}

// addPublishFlags adds the flags of the publisher of the access provider,
// and of the wait for the agents before readiness.
func addPublishFlags(fs *pflag.FlagSet, cfg *broker.Config) {
	fs.BoolVar(&cfg.PublishAccessProvider, "publish-access-provider", cfg.PublishAccessProvider, "keep the --access-provider entry (server and CA that the agent advertises, and the exec extension) and the CredentialBrokerConnected condition in the status of every ClusterProfile with a connected agent; needs patch on clusterprofiles/status and a Lease (deploy/components/publish-access-provider)")
	fs.StringVar(&cfg.PublishLeaseNamespace, "publish-lease-namespace", cfg.PublishLeaseNamespace, "namespace of the Lease that picks the one replica that publishes (the broker's own namespace)")
	fs.StringVar(&cfg.PublishLeaseName, "publish-lease-name", cfg.PublishLeaseName, "name of that Lease")
	fs.StringVar(&cfg.PublishIdentity, "publish-identity", cfg.PublishIdentity, "this replica's name in the Leases of the publisher and of the revocation triggers, such as the pod name (default: random)")
	fs.DurationVar(&cfg.AgentReconnectWindow, "agent-reconnect-window", cfg.AgentReconnectWindow, "how long a starting replica waits, at most, for the agents to find it before /readyz reports ready; sooner once every ClusterProfile the publishing replica reports connected has a stream here; 0 does not wait")
	fs.BoolVar(&cfg.PublishControlPlaneHealthy, "publish-control-plane-healthy", cfg.PublishControlPlaneHealthy, "with --publish-access-provider, also keep the ControlPlaneHealthy condition (which multicluster-runtime gates on) from the agents' reports of their spoke's /readyz, on every ClusterProfile where no other field manager owns it; turn it on only when no cluster manager writes that condition")
	fs.DurationVar(&cfg.PublishDisconnectGrace, "publish-disconnect-grace", cfg.PublishDisconnectGrace, "how long a ClusterProfile has no agent before its CredentialBrokerConnected condition turns False")
}

// addCheckFlags adds the flags of gRPC reflection, of the limits on
// TokenReviews per peer and per namespace, of the hub issuer's keys, and of
// the checks of live grants against hub RBAC.
func addCheckFlags(fs *pflag.FlagSet, cfg *broker.Config) {
	fs.BoolVar(&cfg.EnableReflection, "enable-reflection", cfg.EnableReflection, "serve gRPC server reflection on the exchange port, for debugging")
	fs.Float64Var(&cfg.PeerReviewRateLimit, "peer-review-rate-limit", cfg.PeerReviewRateLimit, "TokenReviews per second of tokens not in the cache, per caller IP address")
	fs.IntVar(&cfg.PeerReviewBurst, "peer-review-burst", cfg.PeerReviewBurst, "burst of TokenReviews of tokens not in the cache, per caller IP address")
	fs.Float64Var(&cfg.NamespaceReviewRateLimit, "namespace-review-rate-limit", cfg.NamespaceReviewRateLimit, "TokenReviews per second of tokens not in the cache, per hub namespace that the verified token names, from any address")
	fs.IntVar(&cfg.NamespaceReviewBurst, "namespace-review-burst", cfg.NamespaceReviewBurst, "burst of TokenReviews of tokens not in the cache, per hub namespace that the verified token names")
	fs.StringVar(&cfg.IssuerJWKSFile, "issuer-jwks-file", "", "JWKS (JSON) file of the hub service-account issuer's public keys, reloaded on change; empty means the hub's /openid/v1/jwks")
	fs.DurationVar(&cfg.IssuerKeysRefresh, "issuer-keys-refresh", cfg.IssuerKeysRefresh, "how often the hub issuer's public keys are fetched from the hub")
	fs.DurationVar(&cfg.IssuerKeysMinRefresh, "issuer-keys-min-refresh", cfg.IssuerKeysMinRefresh, "least time between two fetches of the hub issuer's keys, which a token naming an unknown key also triggers")
	fs.StringVar(&cfg.TriggerLeaseName, "trigger-lease-name", cfg.TriggerLeaseName, "Lease, in --pending-revokes-namespace, that picks the one replica that runs the revocation triggers; it checks every live grant when it takes over; empty runs them on this replica with no Lease (one replica only)")
	fs.DurationVar(&cfg.GrantRecheckInterval, "grant-recheck-interval", cfg.GrantRecheckInterval, "how often every live grant is checked against hub RBAC, its ClusterProfile and its consumer's hub ServiceAccount")
	fs.DurationVar(&cfg.RBACDebounce, "rbac-debounce", cfg.RBACDebounce, "quiet time after a hub RBAC change before live grants are checked again")
	fs.DurationVar(&cfg.RBACDebounceMax, "rbac-debounce-max", cfg.RBACDebounceMax, "longest wait from a hub RBAC change to the check of live grants, however many changes follow")
	fs.Float64Var(&cfg.GrantReviewRateLimit, "grant-review-rate-limit", cfg.GrantReviewRateLimit, "SubjectAccessReviews per second when live grants are checked again")
	fs.IntVar(&cfg.GrantReviewBurst, "grant-review-burst", cfg.GrantReviewBurst, "burst of SubjectAccessReviews when live grants are checked again")
}

// addCapacityFlags adds the flags of the shutdown, of the streams and
// grants a replica holds, and of profiling.
func addCapacityFlags(fs *pflag.FlagSet, cfg *broker.Config) {
	fs.DurationVar(&cfg.ShutdownGrace, "shutdown-grace", cfg.ShutdownGrace, "on SIGTERM, how long the broker may take to finish the exchanges in flight and close its agent streams; keep it under the pod's terminationGracePeriodSeconds")
	fs.DurationVar(&cfg.ShutdownDelay, "shutdown-delay", cfg.ShutdownDelay, "on SIGTERM, how long the broker, already not ready, still serves new calls, for the Service to drop it first (part of --shutdown-grace)")
	fs.IntVar(&cfg.MaxStreamsPerCluster, "max-streams-per-cluster", cfg.MaxStreamsPerCluster, "agent streams one ClusterProfile may hold to this replica: at least its agents' count (one per node for a DaemonSet)")
	fs.IntVar(&cfg.MaxGrantBytesPerCluster, "max-grant-bytes-per-cluster", cfg.MaxGrantBytesPerCluster, "bytes of the grants one ClusterProfile's agents report that this replica holds (about 50,000 grants by default); a report past it closes the agent's stream")
	fs.Var(&positiveUint32Value{&cfg.MaxConcurrentStreams}, "max-concurrent-streams", "concurrent calls (HTTP/2 streams) per connection on both gRPC ports")
	fs.BoolVar(&cfg.Profiling, "profiling", cfg.Profiling, "serve net/http/pprof under /debug/pprof/ on --metrics-address, for profiling (CPU, heap, allocs, mutex, block, goroutines)")
}

// addProxyFlags adds the flags of the API proxy.
func addProxyFlags(fs *pflag.FlagSet, cfg *broker.Config, o *options) {
	fs.StringVar(&cfg.ProxyAddress, "proxy-address", "", "address of the API proxy (TLS, with --tls-cert-file), which carries consumers' requests to the spoke API servers that agents offer through their data path; empty disables it")
	fs.StringVar(&cfg.ProxyURL, "proxy-url", "", "https base URL of --proxy-address as consumers reach it, such as https://credbroker.credbroker-system.svc:8445; with --publish-access-provider, published with /clusters/<namespace>/<name> for a ClusterProfile whose agents offer a data path and advertise no server")
	fs.StringVar(&o.proxyCA, "proxy-ca-file", "", "PEM CA bundle that verifies --proxy-url, published with it")
	fs.IntVar(&cfg.ProxyMaxRequestsPerCluster, "proxy-max-requests-per-cluster", cfg.ProxyMaxRequestsPerCluster, "proxied requests in flight to one ClusterProfile (watches and upgraded connections included)")
	fs.IntVar(&cfg.ProxyMaxRequestsPerConsumer, "proxy-max-requests-per-consumer", cfg.ProxyMaxRequestsPerConsumer, "proxied requests in flight of one hub consumer")
	fs.DurationVar(&cfg.ProxyResponseHeaderTimeout, "proxy-response-header-timeout", cfg.ProxyResponseHeaderTimeout, "how long the API proxy waits for a spoke API server's answer to start")
	fs.DurationVar(&cfg.ProxyIdleTimeout, "proxy-idle-timeout", cfg.ProxyIdleTimeout, "how long the API proxy keeps a consumer's idle connection open")
}

// positiveUint32Value is a flag of a positive uint32.
type positiveUint32Value struct{ p *uint32 }

func (v *positiveUint32Value) Set(s string) error {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil || n == 0 {
		return fmt.Errorf("not a positive 32-bit integer: %q", s)
	}
	*v.p = uint32(n)
	return nil
}
func (v *positiveUint32Value) String() string { return strconv.FormatUint(uint64(*v.p), 10) }
func (v *positiveUint32Value) Type() string   { return "uint32" }

// serviceAccountNamespace is where the kubelet writes the pod's namespace.
const serviceAccountNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// ownNamespace is the broker's pod's namespace, or outside a pod the
// default of broker.Config.PendingRevokesNamespace.
func ownNamespace() string {
	if raw, err := os.ReadFile(serviceAccountNamespace); err == nil {
		if ns := strings.TrimSpace(string(raw)); ns != "" {
			return ns
		}
	}
	return broker.Default().PendingRevokesNamespace
}
