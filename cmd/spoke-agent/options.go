package main

import (
	"fmt"
	"os"
	"strings"

	"github.com/spf13/pflag"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/internal/cmdflags/identityflags"
	"github.com/credbroker/credbroker/pkg/agent"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/spoke"
)

const usage = `Usage: spoke-agent --broker-address HOST:PORT --trust-domain TD (--svid-cert-file F --svid-key-file F --trust-bundle-file F | --spiffe-endpoint-socket S) [flags]

The spoke side of credbroker: it holds a stream to every broker replica and
mints ServiceAccount tokens under the spoke's policy. Logs go to standard
error.`

// options are the agent's flags that parseFlags turns into agent.Config
// fields once they are parsed.
type options struct {
	kubeconfig, brokerID, brokers, cluster, advertiseCA string
	allowEscalating                                     []string
	identity                                            identityflags.Flags
}

// parseFlags turns the command line into a validated agent.Config. It
// returns cmdflags.ErrVersion for --version and an error wrapping
// pflag.ErrHelp for --help.
func parseFlags(args []string) (agent.Config, error) {
	cfg := agent.Default()
	var o options
	fs, common := cmdflags.New("spoke-agent", usage)
	addFlags(fs, &cfg, &o)
	common.AddLogFlags()
	if err := common.Parse(args); err != nil {
		return cfg, err
	}
	cfg.Log = common.Logger(os.Stderr).WithName("spoke-agent")
	if err := o.complete(&cfg); err != nil {
		return cfg, err
	}
	if !fs.Changed("data-path") {
		// On by default for a spoke whose server the hub is not told of,
		// when the spoke config names the CA to send to the brokers.
		cfg.DataPath = cfg.AdvertiseServer == "" && agent.CheckDataPath(cfg.Spoke) == nil
	}
	return cfg, cfg.Validate()
}

// addFlags adds the agent's flags to fs, which set cfg and o.
func addFlags(fs *pflag.FlagSet, cfg *agent.Config, o *options) {
	f := cmdflags.Fields{FlagSet: fs}
	f.String(&o.brokers, "broker-address", "broker AgentTunnel target(s), host:port, comma-separated; a DNS name such as the broker's headless Service is re-resolved and one stream kept per address (required)")
	f.String(&o.brokerID, "broker-spiffe-id", "SPIFFE ID the broker must present (default spiffe://<trust-domain>/broker)")
	o.identity = identityflags.Flags{
		Whose:                "agent",
		SVIDCertFileUsage:    "PEM X.509-SVID of the agent, spiffe://<td>/clusterprofile/<ns>/<name>; reloaded on change (this or --spiffe-endpoint-socket)",
		TrustBundleFileUsage: "PEM CA certificates of the trust domain; with --svid-cert-file",
		SPIFFEIDUsage: "the agent's own SPIFFE ID, which the Workload API's SVID must have (default: that of --cluster, " +
			"spiffe://<trust-domain>/clusterprofile/<namespace>/<name>; without --cluster, the first SVID of the trust domain)",
		TrustDomainUsage: "SPIFFE trust domain (required)",
	}
	o.identity.AddFlags(fs, &cfg.Config)
	f.String(&o.cluster, "cluster", "namespace/name of the hub ClusterProfile this agent serves; a broker that admits it for another is refused (recommended)")
	f.String(&o.kubeconfig, "kubeconfig", "kubeconfig of the spoke; empty means the in-cluster config")
	f.String(&cfg.Namespace, "namespace", "only mint for ServiceAccounts of this namespace; empty means all")
	fs.StringSliceVar(&o.allowEscalating, "allow-escalating-service-accounts", nil, "ServiceAccounts that the agent mints for even though they may create ServiceAccount tokens or impersonate, with which their tokens can outlive every revoke: namespace/name or namespace/* (every one of the namespace), comma-separated or repeated; default: none")
	f.Duration(&cfg.MaxExpiration, "max-expiration", "longest lifetime of a minted token (at least 10m)")
	f.Duration(&cfg.MintTimeout, "mint-timeout", "bound on one TokenRequest; keep it at least the broker's --mint-timeout")
	f.Duration(&cfg.CollectInterval, "grant-collect-interval", "how often to delete the grant Secrets of expired tokens, including those a previous agent left")
	f.Int(&cfg.GrantPoolSize, "grant-pool-size", "grant Secrets kept ready per ServiceAccount minted for, so that a mint waits for its TokenRequest only; 0 creates each grant on the mint's path")
	f.String(&cfg.MetricsAddress, "metrics-address", "address of /metrics, /healthz and /readyz; empty disables them")
	f.Duration(&cfg.ShutdownGrace, "shutdown-grace", "on SIGTERM, how long the agent may take to answer the requests in flight before it closes its broker streams; keep it under the pod's terminationGracePeriodSeconds")
	f.Int(&cfg.MaxInFlight, "max-in-flight", "concurrent mints and revokes per broker stream")
	f.Duration(&cfg.KeepaliveTime, "keepalive-time", "ping a broker after its connection has been silent this long (at least 10s, gRPC's floor for clients)")
	f.Duration(&cfg.KeepaliveTimeout, "keepalive-timeout", "reconnect when a ping is not answered in this long; with --keepalive-time, bounds how long a silent partition goes unnoticed")
	f.Float32(&cfg.SpokeQPS, "spoke-qps", "QPS of each of the agent's spoke clients: its TokenRequests, its escalation reviews, and the rest (client-go's 5 would throttle mints, which cost three requests each)")
	f.Int(&cfg.SpokeBurst, "spoke-burst", "burst of each of the agent's spoke clients")
	f.Duration(&cfg.SpokeHealthInterval, "spoke-health-interval", "how often to ask the spoke API server's /readyz and report it to the brokers, which keep ControlPlaneHealthy from it with --publish-control-plane-healthy; 0 turns it off")
	f.Int(&cfg.SpokeHealthFailureThreshold, "spoke-health-failure-threshold", "failures of /readyz in a row before the agent reports the spoke not ready")
	f.String(&cfg.AdvertiseServer, "advertise-server", "https URL of this spoke's API server as the hub reaches it, sent to the broker for its published access provider (the agent never guesses it)")
	f.String(&o.advertiseCA, "advertise-ca-file", "PEM CA bundle that verifies --advertise-server")
	f.Bool(&cfg.DataPath, "data-path", "carry the broker's API proxy connections to this spoke's API server (konnectivity), for a hub that cannot reach it; default: on when --advertise-server is not set and the spoke config names its CA")
}

// complete sets the fields of cfg that the parsed options o stand for.
func (o *options) complete(cfg *agent.Config) (err error) {
	for _, b := range strings.Split(o.brokers, ",") {
		if b = strings.TrimSpace(b); b != "" {
			cfg.BrokerAddresses = append(cfg.BrokerAddresses, b)
		}
	}
	if o.cluster != "" {
		ns, name, ok := strings.Cut(o.cluster, "/")
		if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
			return fmt.Errorf("--cluster %q: want namespace/name", o.cluster)
		}
		cfg.Cluster = types.NamespacedName{Namespace: ns, Name: name}
	}
	for _, a := range o.allowEscalating {
		n, err := spoke.ParseAllowEscalating(strings.TrimSpace(a))
		if err != nil {
			return fmt.Errorf("--allow-escalating-service-accounts: %w", err)
		}
		cfg.AllowEscalatingServiceAccounts = append(cfg.AllowEscalatingServiceAccounts, n)
	}
	if err := o.identity.Apply(); err != nil {
		return err
	}
	if !cfg.TrustDomain.IsZero() {
		cfg.BrokerID = fleet.BrokerID(cfg.TrustDomain)
	}
	if o.brokerID != "" {
		if cfg.BrokerID, err = spiffeid.FromString(o.brokerID); err != nil {
			return fmt.Errorf("--broker-spiffe-id: %w", err)
		}
	}
	if o.advertiseCA != "" {
		if cfg.AdvertiseCAData, err = os.ReadFile(o.advertiseCA); err != nil {
			return fmt.Errorf("--advertise-ca-file: %w", err)
		}
	}
	if cfg.Spoke, err = clientcmd.BuildConfigFromFlags("", o.kubeconfig); err != nil {
		return fmt.Errorf("spoke config: %w", err)
	}
	return nil
}
