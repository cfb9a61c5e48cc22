package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/internal/cmdflags/identityflags"
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
	identity            identityflags.Flags
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
	f := cmdflags.Fields{FlagSet: fs}
	addListenerFlags(f, &cfg, &o)
	addExchangeFlags(f, &cfg)
	addPublishFlags(f, &cfg)
	addCheckFlags(f, &cfg)
	addCapacityFlags(f, &cfg)
	addProxyFlags(f, &cfg, &o)
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
	if cfg.PublishLeaseNamespace == "" {
		cfg.PublishLeaseNamespace = ownNamespace()
	}
	if cfg.Hub, err = clientcmd.BuildConfigFromFlags("", o.kubeconfig); err != nil {
		return fmt.Errorf("hub config: %w", err)
	}
	return nil
}

// addListenerFlags adds the flags of the broker's listeners, its
// certificates and SPIFFE identity, and the hub it serves.
func addListenerFlags(f cmdflags.Fields, cfg *broker.Config, o *options) {
	f.String(&cfg.ExchangeAddress, "exchange-address", "address of the TokenExchange gRPC server (TLS) for consumers")
	f.String(&cfg.AgentAddress, "agent-address", "address of the AgentTunnel gRPC server (SPIFFE mTLS) for spoke agents")
	f.String(&cfg.MetricsAddress, "metrics-address", "address of /metrics, /healthz and /readyz; empty disables them")
	f.String(&cfg.TLSCertFile, "tls-cert-file", "PEM serving certificate of the exchange port; reloaded on change (required)")
	f.String(&cfg.TLSKeyFile, "tls-key-file", "PEM key of --tls-cert-file (required)")
	o.identity = identityflags.Flags{
		Whose:                "broker",
		SVIDCertFileUsage:    "PEM X.509-SVID of the broker, leaf first; reloaded on change (this or --spiffe-endpoint-socket)",
		TrustBundleFileUsage: "PEM CA certificates of the trust domain that agents' SVIDs chain to; with --svid-cert-file",
		SPIFFEIDUsage:        "the broker's own SPIFFE ID, which the Workload API's SVID must have (default spiffe://<trust-domain>/broker)",
		TrustDomainUsage:     "SPIFFE trust domain of the broker and the agents, e.g. fleet.example (required)",
	}
	o.identity.AddFlags(f.FlagSet, &cfg.Config)
	f.String(&o.kubeconfig, "kubeconfig", "kubeconfig of the hub; empty means the in-cluster config")
}

// addExchangeFlags adds the flags of the exchanges: the hub client, the
// tokens minted, the agent connections that carry the mints, and the
// decision caches and rate limits.
func addExchangeFlags(f cmdflags.Fields, cfg *broker.Config) {
	f.Float32(&cfg.HubQPS, "hub-qps", "QPS of the hub client")
	f.Int(&cfg.HubBurst, "hub-burst", "burst of the hub client")
	f.String(&cfg.Audience, "audience", "audience that consumers' hub tokens must carry")
	f.FlagSet.StringVar(&cfg.PendingRevokesNamespace, "pending-revokes-namespace", "", "namespace of the ConfigMap credbroker-pending-revokes, where the replicas record the revokes no agent confirmed yet, for every replica to send again (default: the broker's own namespace in a pod, else credbroker-system)")
	f.Duration(&cfg.MaxExpiration, "max-expiration", "longest lifetime of a minted spoke token (at least 10m)")
	f.Duration(&cfg.MintTimeout, "mint-timeout", "how long to wait for an agent's answer")
	f.Duration(&cfg.AgentReturnWait, "agent-return-wait", "how long an exchange that needs an agent waits for one when its cluster's last agent stream ended less than this long ago, as when a stream breaks and its agent reconnects (under --mint-timeout; 0: refuse at once)")
	f.Duration(&cfg.AgentMaxConnectionAge, "agent-max-connection-age", "renew each agent connection after about this long, so that handshakes use current SVIDs and bundle")
	f.Duration(&cfg.AgentMaxConnectionAgeGrace, "agent-max-connection-age-grace", "how long a renewed agent connection may finish its mints (at least --mint-timeout)")
	f.Duration(&cfg.AgentKeepaliveTime, "agent-keepalive-time", "ping an agent after its connection has been silent this long")
	f.Duration(&cfg.AgentKeepaliveTimeout, "agent-keepalive-timeout", "close an agent connection whose ping is not answered in this long; with --agent-keepalive-time, bounds how long a silent partition goes unnoticed (the sum must stay under --mint-timeout)")
	f.String(&cfg.AccessProviderName, "access-provider", "ClusterProfile access provider whose server and CA are returned to consumers")
	f.Duration(&cfg.AuthnTTL, "authn-cache-ttl", "how long a successful TokenReview is reused (never past the token's expiry)")
	f.Duration(&cfg.AllowTTL, "authz-allow-ttl", "how long an allowed SubjectAccessReview is reused")
	f.Duration(&cfg.DenyTTL, "authz-deny-ttl", "how long a denied SubjectAccessReview or failed TokenReview is reused")
	f.Float64(&cfg.RateLimit, "rate-limit", "mints and hub reviews per second allowed per consumer (answers from the cache are free)")
	f.Int(&cfg.RateBurst, "rate-burst", "burst of mints and hub reviews allowed per consumer: a consumer's start with N ClusterProfiles costs 2N (a SubjectAccessReview and a mint each)")
	f.Float64(&cfg.ReviewRateLimit, "review-rate-limit", "TokenReviews per second of tokens not in the cache, all callers together")
	f.Int(&cfg.ReviewBurst, "review-burst", "burst of TokenReviews of tokens not in the cache")
}

// addPublishFlags adds the flags of the publisher of the access provider,
// and of the wait for the agents before readiness.
func addPublishFlags(f cmdflags.Fields, cfg *broker.Config) {
	f.Bool(&cfg.PublishAccessProvider, "publish-access-provider", "keep the --access-provider entry (server and CA that the agent advertises, and the exec extension) and the CredentialBrokerConnected condition in the status of every ClusterProfile with a connected agent; needs patch on clusterprofiles/status and a Lease (deploy/components/publish-access-provider)")
	f.String(&cfg.PublishLeaseNamespace, "publish-lease-namespace", "namespace of the Lease that picks the one replica that publishes (default: the broker's own namespace in a pod, else credbroker-system)")
	f.String(&cfg.PublishLeaseName, "publish-lease-name", "name of that Lease")
	f.String(&cfg.PublishIdentity, "publish-identity", "this replica's name in the Leases of the publisher and of the revocation triggers, such as the pod name (default: random)")
	f.Duration(&cfg.AgentReconnectWindow, "agent-reconnect-window", "how long a starting replica waits, at most, for the agents to find it before /readyz reports ready; sooner once every ClusterProfile the publishing replica reports connected has a stream here; 0 does not wait")
	f.Bool(&cfg.PublishControlPlaneHealthy, "publish-control-plane-healthy", "with --publish-access-provider, also keep the ControlPlaneHealthy condition (which multicluster-runtime gates on) from the agents' reports of their spoke's /readyz, on every ClusterProfile where no other field manager owns it; turn it on only when no cluster manager writes that condition")
	f.Duration(&cfg.PublishDisconnectGrace, "publish-disconnect-grace", "how long a ClusterProfile has no agent before its CredentialBrokerConnected condition turns False")
}

// addCheckFlags adds the flags of gRPC reflection, of the limits on
// TokenReviews per peer and per namespace, of the hub issuer's keys, and of
// the checks of live grants against hub RBAC.
func addCheckFlags(f cmdflags.Fields, cfg *broker.Config) {
	f.Bool(&cfg.EnableReflection, "enable-reflection", "serve gRPC server reflection on the exchange port, for debugging")
	f.Float64(&cfg.PeerReviewRateLimit, "peer-review-rate-limit", "TokenReviews per second of tokens not in the cache, per caller IP address")
	f.Int(&cfg.PeerReviewBurst, "peer-review-burst", "burst of TokenReviews of tokens not in the cache, per caller IP address")
	f.Float64(&cfg.NamespaceReviewRateLimit, "namespace-review-rate-limit", "TokenReviews per second of tokens not in the cache, per hub namespace that the verified token names, from any address")
	f.Int(&cfg.NamespaceReviewBurst, "namespace-review-burst", "burst of TokenReviews of tokens not in the cache, per hub namespace that the verified token names")
	f.String(&cfg.IssuerJWKSFile, "issuer-jwks-file", "JWKS (JSON) file of the hub service-account issuer's public keys, reloaded on change; empty means the hub's /openid/v1/jwks")
	f.Duration(&cfg.IssuerKeysRefresh, "issuer-keys-refresh", "how often the hub issuer's public keys are fetched from the hub")
	f.Duration(&cfg.IssuerKeysMinRefresh, "issuer-keys-min-refresh", "least time between two fetches of the hub issuer's keys, which a token naming an unknown key also triggers")
	f.String(&cfg.TriggerLeaseName, "trigger-lease-name", "Lease, in --pending-revokes-namespace, that picks the one replica that runs the revocation triggers; it checks every live grant when it takes over; empty runs them on this replica with no Lease (one replica only)")
	f.Duration(&cfg.GrantRecheckInterval, "grant-recheck-interval", "how often every live grant is checked against hub RBAC, its ClusterProfile and its consumer's hub ServiceAccount")
	f.Duration(&cfg.RBACDebounce, "rbac-debounce", "quiet time after a hub RBAC change before live grants are checked again")
	f.Duration(&cfg.RBACDebounceMax, "rbac-debounce-max", "longest wait from a hub RBAC change to the check of live grants, however many changes follow")
	f.Float64(&cfg.GrantReviewRateLimit, "grant-review-rate-limit", "SubjectAccessReviews per second when live grants are checked again")
	f.Int(&cfg.GrantReviewBurst, "grant-review-burst", "burst of SubjectAccessReviews when live grants are checked again")
}

// addCapacityFlags adds the flags of the shutdown, of the streams and
// grants a replica holds, and of profiling.
func addCapacityFlags(f cmdflags.Fields, cfg *broker.Config) {
	f.Duration(&cfg.ShutdownGrace, "shutdown-grace", "on SIGTERM, how long the broker may take to finish the exchanges in flight and close its agent streams; keep it under the pod's terminationGracePeriodSeconds")
	f.Duration(&cfg.ShutdownDelay, "shutdown-delay", "on SIGTERM, how long the broker, already not ready, still serves new calls, for the Service to drop it first (part of --shutdown-grace)")
	f.Int(&cfg.MaxStreamsPerCluster, "max-streams-per-cluster", "agent streams one ClusterProfile may hold to this replica: at least its agents' count (one per node for a DaemonSet)")
	f.Int(&cfg.MaxGrantBytesPerCluster, "max-grant-bytes-per-cluster", "bytes of the grants one ClusterProfile's agents report that this replica holds (about 50,000 grants by default); a report past it closes the agent's stream")
	f.FlagSet.Var(&positiveUint32Value{&cfg.MaxConcurrentStreams}, "max-concurrent-streams", "concurrent calls (HTTP/2 streams) per connection on both gRPC ports")
	f.Bool(&cfg.Profiling, "profiling", "serve net/http/pprof under /debug/pprof/ on --metrics-address, for profiling (CPU, heap, allocs, mutex, block, goroutines)")
}

// addProxyFlags adds the flags of the API proxy.
func addProxyFlags(f cmdflags.Fields, cfg *broker.Config, o *options) {
	f.String(&cfg.ProxyAddress, "proxy-address", "address of the API proxy (TLS, with --tls-cert-file), which carries consumers' requests to the spoke API servers that agents offer through their data path; empty disables it")
	f.String(&cfg.ProxyURL, "proxy-url", "https base URL of --proxy-address as consumers reach it, such as https://credbroker.credbroker-system.svc:8445; with --publish-access-provider, published with /clusters/<namespace>/<name> for a ClusterProfile whose agents offer a data path and advertise no server")
	f.String(&o.proxyCA, "proxy-ca-file", "PEM CA bundle that verifies --proxy-url, published with it")
	f.Int(&cfg.ProxyMaxRequestsPerCluster, "proxy-max-requests-per-cluster", "proxied requests in flight to one ClusterProfile (watches and upgraded connections included)")
	f.Int(&cfg.ProxyMaxRequestsPerConsumer, "proxy-max-requests-per-consumer", "proxied requests in flight of one hub consumer to one ClusterProfile")
	f.Duration(&cfg.ProxyResponseHeaderTimeout, "proxy-response-header-timeout", "how long the API proxy waits for a spoke API server's answer to start")
	f.Duration(&cfg.ProxyIdleTimeout, "proxy-idle-timeout", "how long the API proxy keeps a consumer's idle connection open")
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
// default of broker.Config.PendingRevokesNamespace: where the broker keeps
// its Leases and pending revokes unless a flag names another namespace.
func ownNamespace() string {
	if raw, err := os.ReadFile(serviceAccountNamespace); err == nil {
		if ns := strings.TrimSpace(string(raw)); ns != "" {
			return ns
		}
	}
	return broker.Default().PendingRevokesNamespace
}
