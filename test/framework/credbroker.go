package framework

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/clock"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/agent"
	"github.com/credbroker/credbroker/pkg/apiproxy"
	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/fleet"
	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/plugin"
	spokepkg "github.com/credbroker/credbroker/pkg/spoke"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// Names that a Deployment gives to what it creates.
const (
	// TrustDomain is the SPIFFE trust domain of the broker and the agents.
	TrustDomain = "fleet.credbroker.test"
	// FleetNamespace is the hub namespace of the ClusterProfiles.
	FleetNamespace = "fleet"
	// AgentNamespace and AgentServiceAccount are the agent's identity on a spoke.
	AgentNamespace      = "credbroker-system"
	AgentServiceAccount = "credbroker-agent"
)

// DeploymentOptions configure StartDeployment.
type DeploymentOptions struct {
	// Dir receives the certificates and keys; required.
	Dir string
	// Log receives the broker's and the agents' operational logs, and Audit
	// the broker's audit lines. The zero values discard them.
	Log, Audit logr.Logger
	// MintTimeout is the broker's wait for an agent. Default 10s.
	MintTimeout time.Duration
	// Replicas is the number of brokers. Default 1.
	Replicas int
	// Tune, when set, changes the brokers' config before they start.
	Tune func(*broker.Config)
	// SPIFFEEndpointSocket, when set, is the brokers' SPIFFE Workload API
	// (--spiffe-endpoint-socket), which must serve spiffe://<TrustDomain>/broker,
	// instead of SVID files from the deployment's CA.
	SPIFFEEndpointSocket string
	// AuditDir, when set, receives each replica's audit lines as the broker
	// binary writes them to --audit-log-path (JSON lines, whatever the
	// operational log format), in broker-<i>.audit.log, besides Audit; a
	// restarted replica appends to its file. AuditLogs lists the files.
	AuditDir string
	// NoInProcessBroker starts no broker in this process: the test runs
	// the broker binary (StartBrokerProcess) and points its agents at it
	// (AgentProcessOptions.BrokerAddresses). Broker and Brokers stay nil,
	// and StartAgent, which needs an in-process broker, must not be used.
	NoInProcessBroker bool
}

// Deployment is credbroker running in-process over an Env: a broker
// against the hub, a ClusterProfile per spoke, and the agents started with
// StartAgent. Stop it before the Env.
type Deployment struct {
	Env *Env
	// CA issues every certificate: the broker's serving certificate and
	// every SVID. CAFile is its PEM, which consumers use to verify the broker.
	CA     *testpki.CA
	CAFile string
	// Brokers are the replicas, which share nothing but the hub; Broker is
	// the first. Every agent holds a stream to each.
	Broker  *broker.Broker
	Brokers []*broker.Broker

	dir  string
	opts DeploymentOptions
	ctx  context.Context
	// brokerCfg is the replicas' config; brokerStops and brokerDone stop
	// each replica and tell when it has.
	brokerCfg   broker.Config
	brokerStops []context.CancelFunc
	brokerDone  []chan struct{}
	// agents lists the running agents by spoke name; guarded by mu.
	agents map[string][]*agent.Agent
	// agentSVIDs lists, by spoke name and SPIFFE ID, the folders of the
	// SVID files of every agent started with that ID, one per agent;
	// svidDirs counts them. Guarded by mu.
	agentSVIDs map[string][]string
	svidDirs   int
	stop       context.CancelFunc
	wg         sync.WaitGroup
	mu         sync.Mutex
	errs       []error

	// tlsCert and tlsKey are the brokers' exchange port certificate files.
	tlsCert, tlsKey string
	// auditFiles are the replicas' audit logs when AuditDir is set; the
	// open ones are closed by Stop.
	auditFiles   []string
	auditClosers []io.Closer
}

// StartDeployment starts a broker against env's hub and creates, on the hub,
// one ClusterProfile per spoke in FleetNamespace, named after the spoke, with
// a "credbroker" access provider (see ClusterProfileAccess). It starts no
// agent.
func StartDeployment(ctx context.Context, env *Env, opts DeploymentOptions) (*Deployment, error) {
	if opts.Dir == "" {
		return nil, errors.New("framework: DeploymentOptions.Dir is required")
	}
	ca, err := testpki.NewCA(TrustDomain)
	if err != nil {
		return nil, err
	}
	d := &Deployment{Env: env, CA: ca, dir: opts.Dir, opts: opts, agents: map[string][]*agent.Agent{}, agentSVIDs: map[string][]string{}}
	if d.CAFile, err = ca.WriteBundle(opts.Dir); err != nil {
		return nil, err
	}
	tlsCert, tlsKey, err := ca.WriteServing(opts.Dir, "127.0.0.1", "localhost")
	if err != nil {
		return nil, err
	}
	svidCert, svidKey, err := ca.WriteSVID(opts.Dir, "spiffe://"+TrustDomain+"/broker")
	if err != nil {
		return nil, err
	}

	cfg := broker.Default()
	cfg.ExchangeAddress, cfg.AgentAddress, cfg.MetricsAddress = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	// The API proxy serves with the exchange port's certificate.
	cfg.ProxyAddress = "127.0.0.1:0"
	cfg.TLSCertFile, cfg.TLSKeyFile = tlsCert, tlsKey
	d.tlsCert, d.tlsKey = tlsCert, tlsKey
	if opts.SPIFFEEndpointSocket != "" {
		cfg.SPIFFEEndpointSocket = opts.SPIFFEEndpointSocket
	} else {
		cfg.SVIDCertFile, cfg.SVIDKeyFile, cfg.TrustBundleFile = svidCert, svidKey, d.CAFile
	}
	cfg.TrustDomain = ca.TrustDomain()
	cfg.Hub = env.Hub.Config
	cfg.Log, cfg.Audit = opts.Log.WithName("broker"), opts.Audit
	cfg.ShutdownGrace = time.Second
	// The tests start the brokers before their agents, and count on them
	// being ready at once; readiness's wait for the agents is
	// TestReadinessWaitsForTheAgents's.
	cfg.AgentReconnectWindow = 0
	if opts.MintTimeout > 0 {
		cfg.MintTimeout = opts.MintTimeout
		// A partitioned agent's stream must close before its mints time
		// out (Config.Validate).
		if cfg.AgentKeepaliveTime+cfg.AgentKeepaliveTimeout >= cfg.MintTimeout {
			cfg.AgentKeepaliveTime, cfg.AgentKeepaliveTimeout = cfg.MintTimeout/2, cfg.MintTimeout/4
		}
	}
	if opts.Tune != nil {
		opts.Tune(&cfg)
	}
	// The brokers record pending revokes in a ConfigMap of their own
	// namespace, as deploy/hub's broker does in credbroker-system.
	if err := env.Hub.EnsureNamespace(ctx, cfg.PendingRevokesNamespace); err != nil {
		return nil, err
	}
	d.ctx, d.stop = context.WithCancel(context.Background())
	d.brokerCfg = cfg
	replicas := max(opts.Replicas, 1)
	if opts.NoInProcessBroker {
		replicas = 0
	}
	for i := range replicas {
		rcfg, err := d.replicaConfig(i)
		if err != nil {
			return nil, errors.Join(err, d.Stop())
		}
		b, err := broker.New(rcfg)
		if err != nil {
			return nil, errors.Join(err, d.Stop())
		}
		d.Brokers = append(d.Brokers, b)
		d.brokerStops, d.brokerDone = append(d.brokerStops, nil), append(d.brokerDone, nil)
		d.runBroker(i, b)
	}
	if len(d.Brokers) > 0 {
		d.Broker = d.Brokers[0]
	}

	for _, spoke := range env.Spokes {
		if _, err := env.Hub.CreateClusterProfile(ctx, FleetNamespace, spoke.Name, d.ClusterProfileAccess(spoke)); err != nil {
			return nil, errors.Join(err, d.Stop())
		}
	}
	return d, nil
}

// runBroker runs b as replica i until RestartBroker or Stop.
func (d *Deployment) runBroker(i int, b *broker.Broker) {
	ctx, cancel := context.WithCancel(d.ctx)
	done := make(chan struct{})
	d.brokerStops[i], d.brokerDone[i] = cancel, done
	d.run(fmt.Sprintf("broker-%d", i), func(context.Context) error {
		defer close(done)
		return b.Run(ctx)
	})
}

// RestartBroker stops broker replica i as SIGTERM would (it drains within
// its shutdown grace), then starts a new replica on the same addresses, as
// a restarted pod behind the same Service, and returns once it runs. The
// agents reconnect on their own. It returns how long the old replica took
// to drain.
func (d *Deployment) RestartBroker(i int) (drained time.Duration, err error) {
	old := d.Brokers[i]
	start := time.Now()
	d.brokerStops[i]()
	<-d.brokerDone[i]
	drained = time.Since(start)
	cfg, err := d.replicaConfig(i)
	if err != nil {
		return drained, fmt.Errorf("framework: restart broker-%d: %w", i, err)
	}
	cfg.ExchangeAddress, cfg.AgentAddress, cfg.MetricsAddress = old.ExchangeAddr(), old.AgentAddr(), old.MetricsAddr()
	if cfg.ProxyAddress != "" {
		cfg.ProxyAddress = old.ProxyAddr()
	}
	b, err := broker.New(cfg)
	if err != nil {
		return drained, fmt.Errorf("framework: restart broker-%d: %w", i, err)
	}
	d.mu.Lock()
	d.Brokers[i] = b
	d.Broker = d.Brokers[0]
	d.mu.Unlock()
	d.runBroker(i, b)
	return drained, nil
}

// replicaConfig is the config of replica i: the deployment's, with its own
// audit log when AuditDir is set.
func (d *Deployment) replicaConfig(i int) (broker.Config, error) {
	cfg := d.brokerCfg
	if d.opts.AuditDir == "" {
		return cfg, nil
	}
	name := filepath.Join(d.opts.AuditDir, fmt.Sprintf("broker-%d.audit.log", i))
	w, err := cmdflags.OpenAuditLog(name, 100, 5)
	if err != nil {
		return cfg, err
	}
	d.mu.Lock()
	if !slices.Contains(d.auditFiles, name) {
		d.auditFiles = append(d.auditFiles, name)
	}
	d.auditClosers = append(d.auditClosers, w)
	d.mu.Unlock()
	// The exchange lines are encoded by the exchange, into the file and,
	// decoded again, the test log.
	cfg.AuditLog = io.MultiWriter(w, auditLines{cfg.Audit})
	cfg.Audit = logr.New(teeSink{cfg.Audit.GetSink(), cmdflags.AuditLogger(w).GetSink()})
	return cfg, nil
}

// AuditLogs returns the replicas' audit log files (see
// DeploymentOptions.AuditDir).
func (d *Deployment) AuditLogs() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.auditFiles)
}

// teeSink writes every line to both sinks; a nil sink (logr.Discard) is
// skipped.
type teeSink struct{ a, b logr.LogSink }

func (t teeSink) each(fn func(logr.LogSink)) {
	for _, s := range []logr.LogSink{t.a, t.b} {
		if s != nil {
			fn(s)
		}
	}
}

// Init does nothing: both sinks were initialized by the loggers they come
// from, and one of them is shared with the other replicas, which read it
// while this one starts (Init writes to it: a data race).
func (teeSink) Init(logr.RuntimeInfo) {}

func (t teeSink) Enabled(level int) bool {
	on := false
	t.each(func(s logr.LogSink) { on = on || s.Enabled(level) })
	return on
}

func (t teeSink) Info(level int, msg string, kv ...any) {
	t.each(func(s logr.LogSink) {
		if s.Enabled(level) {
			s.Info(level, msg, kv...)
		}
	})
}

func (t teeSink) Error(err error, msg string, kv ...any) {
	t.each(func(s logr.LogSink) { s.Error(err, msg, kv...) })
}

func (t teeSink) WithValues(kv ...any) logr.LogSink {
	return teeSink{withValues(t.a, kv), withValues(t.b, kv)}
}

func (t teeSink) WithName(name string) logr.LogSink {
	return teeSink{withName(t.a, name), withName(t.b, name)}
}

func withValues(s logr.LogSink, kv []any) logr.LogSink {
	if s == nil {
		return nil
	}
	return s.WithValues(kv...)
}

func withName(s logr.LogSink, name string) logr.LogSink {
	if s == nil {
		return nil
	}
	return s.WithName(name)
}

// ClusterProfileAccess is the "credbroker" access provider of spoke's
// ClusterProfile: its server and CA, and the exec extension that tells
// credbroker-plugin which ClusterProfile it serves.
func (d *Deployment) ClusterProfileAccess(spoke *Cluster) *Access {
	return d.ProfileAccess(spoke, FleetNamespace, spoke.Name)
}

// ProfileAccess is the access provider entry of the ClusterProfile
// namespace/name that reaches spoke: spoke's server and CA, and an exec
// config that names that ClusterProfile itself, as deploy/hub/admission.yaml
// requires of every credbroker entry.
func (d *Deployment) ProfileAccess(spoke *Cluster, namespace, name string) *Access {
	ext, _ := json.Marshal(plugin.ExecConfig{ClusterProfile: &plugin.Reference{Namespace: namespace, Name: name}})
	return spoke.Access(plugin.Name, ext)
}

// DataPathAccess is the access provider entry of the ClusterProfile
// namespace/name whose spoke is reached through the API proxy at proxyURL
// (https://host:port): the proxy's URL of the ClusterProfile and the
// brokers' CA, and the spoke's server name and CA in the data path
// extension, as the publisher pins them or a cluster manager writes them.
func (d *Deployment) DataPathAccess(spoke *Cluster, proxyURL, namespace, name string) (*Access, error) {
	ca, err := os.ReadFile(d.CAFile)
	if err != nil {
		return nil, err
	}
	u, err := url.Parse(spoke.Server)
	if err != nil {
		return nil, err
	}
	access := d.ProfileAccess(spoke, namespace, name)
	access.Server = apiproxy.URL(proxyURL, types.NamespacedName{Namespace: namespace, Name: name})
	access.CAData = ca
	access.Extensions = append(access.Extensions, apiproxy.DataPathExtension(apiproxy.DataPathConfig{
		ServerName: u.Hostname(), CertificateAuthorityData: spoke.CAData,
	}))
	return access, nil
}

// Agents returns the running agents of the spoke named spoke.
func (d *Deployment) Agents(spoke string) []*agent.Agent {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.agents[spoke])
}

// BrokerConfig returns the config the deployment's brokers run with, for a
// test that starts a broker of its own, but for the triggers' Lease: that
// broker campaigns for one of its own, as StartBrokerProcess's do. Sharing
// the replicas' Lease, it could lead their triggers while it runs (when a
// replica restarts, say), knowing only the grants of its own agents.
func (d *Deployment) BrokerConfig() broker.Config {
	cfg := d.brokerCfg
	cfg.TriggerLeaseName = ownTriggerLease()
	return cfg
}

// AgentID is the SPIFFE ID of the agent of the ClusterProfile fleet/<name>.
func AgentID(name string) string {
	return "spiffe://" + TrustDomain + fleet.AgentIDPathPrefix + FleetNamespace + "/" + name
}

// StartAgent starts an agent on spoke that presents the SVID id, with the
// RBAC that agents need on the spoke (and nothing more), and returns once the
// broker has admitted its stream, or with an error when ctx ends first. The
// agent runs until the returned func or Stop is called.
func (d *Deployment) StartAgent(ctx context.Context, spoke *Cluster, id string) (stop func(), err error) {
	return d.StartAgentWith(ctx, spoke, AgentOptions{ID: id})
}

// WriteAgentSVID issues an SVID for id from ca, valid for ttl, and writes it
// where each agent of spoke with that ID reads its own, replacing what they
// hold: they load it at their next file check.
func (d *Deployment) WriteAgentSVID(spoke *Cluster, id string, ca *testpki.CA, ttl time.Duration) error {
	d.mu.Lock()
	dirs := slices.Clone(d.agentSVIDs[agentSVIDKey(spoke, id)])
	d.mu.Unlock()
	if len(dirs) == 0 {
		return fmt.Errorf("framework: no agent of spoke %s was started as %s", spoke.Name, id)
	}
	for _, dir := range dirs {
		if _, _, err := ca.WriteSVIDFor(dir, id, ttl); err != nil {
			return err
		}
	}
	return nil
}

// newAgentSVID issues an SVID for id from ca, valid for ttl, into a folder
// of its own for one agent of spoke, which WriteAgentSVID rotates from then
// on. Each agent reads files of its own: two processes that shared them
// once read the certificate of one write and the key of the next.
func (d *Deployment) newAgentSVID(spoke *Cluster, id string, ca *testpki.CA, ttl time.Duration) (certFile, keyFile string, err error) {
	key := agentSVIDKey(spoke, id)
	d.mu.Lock()
	d.svidDirs++
	dir := filepath.Join(d.dir, fmt.Sprintf("agent-%s-%d", key, d.svidDirs))
	d.agentSVIDs[key] = append(d.agentSVIDs[key], dir)
	d.mu.Unlock()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", "", err
	}
	return ca.WriteSVIDFor(dir, id, ttl)
}

// agentSVIDKey names the agents of spoke with the SPIFFE ID id, as a file
// name.
func agentSVIDKey(spoke *Cluster, id string) string {
	return spoke.Name + "-" + strings.NewReplacer(":", "_", "/", "_").Replace(id)
}

// BrokerID is the SPIFFE ID of the brokers.
func BrokerID() string { return "spiffe://" + TrustDomain + "/broker" }

// WriteBrokerSVID issues the brokers an SVID from the deployment's CA, valid
// for ttl, and writes it over the files they read theirs from: they load it
// at their next file check (broker.Config.FileCheckInterval).
func (d *Deployment) WriteBrokerSVID(ttl time.Duration) error {
	_, _, err := d.CA.WriteSVIDFor(d.dir, BrokerID(), ttl)
	return err
}

// WriteBrokerServing issues the brokers' exchange port a serving certificate
// for 127.0.0.1 and localhost from the deployment's CA, valid for ttl, and
// writes it over the files they read theirs from, like WriteBrokerSVID.
func (d *Deployment) WriteBrokerServing(ttl time.Duration) error {
	certPEM, keyPEM, err := d.CA.IssueServing([]string{"127.0.0.1", "localhost"}, ttl)
	if err != nil {
		return err
	}
	// The key first: a poll between the two writes sees a mismatched pair,
	// logs it and keeps the old one, rather than a new key for an old
	// certificate that would still verify.
	if err := testpki.WriteFileAtomic(d.tlsKey, keyPEM, 0o600); err != nil {
		return err
	}
	return testpki.WriteFileAtomic(d.tlsCert, certPEM, 0o644)
}

// WaitForBrokerCertificates waits until both ports of every replica serve
// a certificate valid for at least validFor: a test that rotated them with
// short lifetimes writes long ones back and calls this before it stops its
// agents, whose revokes need the streams, or hands the replicas on to the
// next test.
func (d *Deployment) WaitForBrokerCertificates(ctx context.Context, validFor time.Duration) error {
	served := func(addr string) (time.Time, error) {
		dialer := &tls.Dialer{Config: &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}} //nolint:gosec // only reads the served certificate's lifetime
		conn, err := dialer.DialContext(ctx, "tcp", addr)
		if err != nil {
			return time.Time{}, err
		}
		defer conn.Close()
		certs := conn.(*tls.Conn).ConnectionState().PeerCertificates
		if len(certs) == 0 {
			return time.Time{}, fmt.Errorf("framework: %s served no certificate", addr)
		}
		return certs[0].NotAfter, nil
	}
	last := "nothing yet"
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		for _, b := range d.Brokers {
			for _, addr := range []string{b.ExchangeAddr(), b.AgentAddr()} {
				notAfter, err := served(addr)
				if err != nil {
					last = fmt.Sprintf("%s: %v", addr, err)
					return false, nil
				}
				if time.Until(notAfter) < validFor {
					last = fmt.Sprintf("%s serves a certificate valid until %s", addr, notAfter.Format(time.RFC3339))
					return false, nil
				}
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("framework: waiting for the brokers to serve certificates valid for %s (last seen: %s): %w", validFor, last, err)
	}
	return nil
}

// AgentOptions configure StartAgentWith.
type AgentOptions struct {
	// ID is the SPIFFE ID of the agent's SVID; required.
	ID string
	// SVIDTTL is how long the SVID is valid from now. Default 1h.
	SVIDTTL time.Duration
	// CA issues the SVID. Default: the deployment's CA.
	CA *testpki.CA
	// Cluster is the agent's --cluster; empty serves whichever
	// ClusterProfile the broker admits it for.
	Cluster string
	// NoWait returns once the agent runs, without waiting for the broker to
	// admit it.
	NoWait bool
	// Log replaces the deployment's log for this agent.
	Log *logr.Logger
	// Namespace is the agent's --namespace: the only namespace whose
	// ServiceAccounts and grants it sees. Empty: every namespace.
	Namespace string
	// CollectInterval is the agent's --grant-collect-interval. Zero: the
	// default.
	CollectInterval time.Duration
	// Tune, when set, changes the agent's config before it starts, such as
	// its advertised server or its broker addresses.
	Tune func(*agent.Config)
	// Clock times the agent's grant expiry. Nil: the real clock.
	Clock clock.WithTickerAndDelayedExecution
	// SPIFFEEndpointSocket, when set, is the agent's SPIFFE Workload API
	// (--spiffe-endpoint-socket), which must serve an SVID for ID; SVIDTTL
	// and CA are then unused.
	SPIFFEEndpointSocket string
	// FileCheckInterval is how often the agent reads its SVID files. Zero:
	// the default.
	FileCheckInterval time.Duration
	// KeepGrants leaves the grants of the agent's ClusterProfile in place
	// when it stops. By default they are revoked first, through the first
	// broker replica, so that no test leaves tokens on a spoke that no agent
	// can revoke any more.
	KeepGrants bool
}

// admissionTimeout bounds StartAgentWith's wait for the agent's first
// stream, whatever the caller's context.
const admissionTimeout = time.Minute

// StartAgentWith is StartAgent with options.
func (d *Deployment) StartAgentWith(ctx context.Context, spoke *Cluster, opts AgentOptions) (stop func(), err error) {
	id := opts.ID
	if err := d.ensureAgentAccount(ctx, spoke); err != nil {
		return nil, err
	}
	tok, err := spoke.Token(ctx, AgentNamespace, AgentServiceAccount, nil, time.Hour)
	if err != nil {
		return nil, err
	}
	ttl := opts.SVIDTTL
	if ttl == 0 {
		ttl = time.Hour
	}
	ca := opts.CA
	if ca == nil {
		ca = d.CA
	}
	cfg := agent.Default()
	if opts.SPIFFEEndpointSocket != "" {
		cfg.SPIFFEEndpointSocket = opts.SPIFFEEndpointSocket
		// One test process may be served the SVIDs of every agent.
		if cfg.SPIFFEID, err = spiffeid.FromString(id); err != nil {
			return nil, err
		}
	} else {
		cert, key, err := d.newAgentSVID(spoke, id, ca, ttl)
		if err != nil {
			return nil, err
		}
		cfg.SVIDCertFile, cfg.SVIDKeyFile, cfg.TrustBundleFile = cert, key, d.CAFile
	}
	if opts.FileCheckInterval != 0 {
		cfg.FileCheckInterval = opts.FileCheckInterval
	}
	for _, b := range d.Brokers {
		cfg.BrokerAddresses = append(cfg.BrokerAddresses, b.AgentAddr())
	}
	cfg.TrustDomain = d.CA.TrustDomain()
	cfg.BrokerID = fleet.BrokerID(cfg.TrustDomain)
	cfg.Spoke = spoke.TokenConfig(tok)
	cfg.InitialBackoff, cfg.MaxBackoff = 50*time.Millisecond, time.Second
	cfg.MetricsAddress, cfg.ShutdownGrace = "127.0.0.1:0", 5*time.Second
	cfg.Log = d.opts.Log.WithName("agent").WithValues("spoke", spoke.Name)
	if opts.Log != nil {
		cfg.Log = *opts.Log
	}
	if opts.Cluster != "" {
		ns, name, _ := strings.Cut(opts.Cluster, "/")
		cfg.Cluster = types.NamespacedName{Namespace: ns, Name: name}
	}
	cfg.Namespace, cfg.Clock = opts.Namespace, opts.Clock
	if opts.CollectInterval != 0 {
		cfg.CollectInterval = opts.CollectInterval
	}
	if opts.Tune != nil {
		opts.Tune(&cfg)
	}
	a, err := agent.New(cfg)
	if err != nil {
		return nil, err
	}
	actx, cancel := context.WithCancel(d.ctx)
	done := make(chan struct{})
	d.run("agent "+spoke.Name, func(context.Context) error {
		defer close(done)
		return a.Run(actx)
	})
	d.mu.Lock()
	d.agents[spoke.Name] = append(d.agents[spoke.Name], a)
	d.mu.Unlock()
	stopAgent := func() {
		var revoked map[string]bool
		if !opts.KeepGrants {
			revoked = d.revokeGrants(spoke, id)
		}
		d.mu.Lock()
		d.agents[spoke.Name] = slices.DeleteFunc(d.agents[spoke.Name], func(x *agent.Agent) bool { return x == a })
		d.mu.Unlock()
		cancel()
		<-done
		if !opts.KeepGrants {
			d.deleteLateGrants(spoke, id, revoked)
		}
	}
	if opts.NoWait {
		return stopAgent, nil
	}
	select {
	case <-a.Connected():
		return stopAgent, nil
	case <-done:
		stopAgent()
		d.mu.Lock()
		defer d.mu.Unlock()
		return nil, fmt.Errorf("framework: agent %s on %s stopped before it was admitted: %w", id, spoke.Name, errors.Join(d.errs...))
	case <-ctx.Done():
		stopAgent()
		return nil, fmt.Errorf("framework: agent %s on %s was not admitted: %w", id, spoke.Name, ctx.Err())
	case <-time.After(admissionTimeout):
		stopAgent()
		return nil, fmt.Errorf("framework: agent %s on %s was not admitted within %s", id, spoke.Name, admissionTimeout)
	}
}

// ensureAgentAccount creates the agent's ServiceAccount on spoke, with the
// permissions of AgentRules, unless it exists.
func (d *Deployment) ensureAgentAccount(ctx context.Context, spoke *Cluster) error {
	if err := spoke.EnsureNamespace(ctx, AgentNamespace); err != nil {
		return err
	}
	if _, err := spoke.CreateServiceAccount(ctx, AgentNamespace, AgentServiceAccount, nil); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return spoke.Grant(ctx, "", ServiceAccountSubject(AgentNamespace, AgentServiceAccount), AgentRules())
}

// revokeGrants revokes the grants of the ClusterProfile whose default agent
// ID is id, if any, once the first replica's registry knows every grant of
// that ClusterProfile on spoke (for 20s at most): a grant minted through
// another replica reaches it in the agent's grant update, a moment after the
// exchange. Failures leave them to the end of the suite, which counts them.
func (d *Deployment) revokeGrants(spoke *Cluster, id string) (revoked map[string]bool) {
	ns, name, ok := profileOfAgent(id)
	if !ok || d.Broker == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(d.ctx, 50*time.Second)
	defer cancel()
	reg := d.Broker.Grants()
	var live []*pb.Grant
	_ = wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		live = reg.Select(grants.Selector{Cluster: types.NamespacedName{Namespace: ns, Name: name}})
		known := map[string]bool{}
		for _, g := range live {
			known[g.GetCredentialId()] = true
		}
		list, err := spoke.Client.CoreV1().Secrets("").List(ctx, metav1.ListOptions{LabelSelector: spokepkg.GrantLabelSelector})
		if err != nil {
			return false, nil
		}
		for _, g := range list.Items {
			if cid := g.Annotations[spokepkg.GrantCredentialIDAnnotation]; cid != "" && !known[cid] &&
				g.Annotations[spokepkg.GrantClusterProfileAnnotation] == ns+"/"+name {
				return false, nil
			}
		}
		return true, nil
	})
	revoked = map[string]bool{}
	for _, g := range live {
		revoked[g.GetCredentialId()] = true
	}
	if len(live) == 0 {
		return revoked
	}
	// An agent whose streams rotate (short SVIDs) may leave a revoke
	// unanswered on a stream that closed under it: it stays pending until
	// every instance answers, so ask again until none is.
	_ = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 25*time.Second, true, func(ctx context.Context) (bool, error) {
		_, live = reg.Revoke(ctx, live, "the test agent stopped")
		return len(live) == 0, nil
	})
	return revoked
}

// deleteLateGrants deletes, as the spoke's admin, the grants of the
// ClusterProfile whose default agent ID is id that its stopped agent
// claimed after revokeGrants looked, and so are not among revoked: an
// exchange answered from a pooled grant just before the agent stopped is
// claimed a moment later, and the agent's Run waits for its claims to land
// before it returns. Deleting a grant revokes its token, as the agent
// would.
func (d *Deployment) deleteLateGrants(spoke *Cluster, id string, revoked map[string]bool) {
	ns, name, ok := profileOfAgent(id)
	if !ok || revoked == nil {
		return
	}
	ctx, cancel := context.WithTimeout(d.ctx, 20*time.Second)
	defer cancel()
	list, err := spoke.Client.CoreV1().Secrets("").List(ctx, metav1.ListOptions{LabelSelector: spokepkg.GrantLabelSelector})
	if err != nil {
		return // the end of the suite counts what is left
	}
	for _, g := range list.Items {
		if cid := g.Annotations[spokepkg.GrantCredentialIDAnnotation]; cid != "" && !revoked[cid] &&
			g.Annotations[spokepkg.GrantClusterProfileAnnotation] == ns+"/"+name {
			_ = spoke.Client.CoreV1().Secrets(g.Namespace).Delete(ctx, g.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &g.UID}})
		}
	}
}

// profileOfAgent returns the ClusterProfile whose default agent ID is id.
func profileOfAgent(id string) (namespace, name string, ok bool) {
	rest, ok := strings.CutPrefix(id, "spiffe://"+TrustDomain+fleet.AgentIDPathPrefix)
	if !ok {
		return "", "", false
	}
	return strings.Cut(rest, "/")
}

// WaitForServiceAccount waits until every running agent of spoke sees sa as
// it is now, so a test that has just created or annotated it does not race
// the agents' informers.
func (d *Deployment) WaitForServiceAccount(ctx context.Context, spoke *Cluster, sa *corev1.ServiceAccount) error {
	last := "nothing yet"
	err := wait.PollUntilContextTimeout(ctx, 5*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		d.mu.Lock()
		defer d.mu.Unlock()
		for i, a := range d.agents[spoke.Name] {
			got, err := a.ServiceAccounts().ServiceAccounts(sa.Namespace).Get(sa.Name)
			if err != nil {
				last = fmt.Sprintf("agent %d of %d: %v", i+1, len(d.agents[spoke.Name]), err)
				return false, nil
			}
			if got.ResourceVersion != sa.ResourceVersion {
				last = fmt.Sprintf("agent %d of %d sees resourceVersion %s", i+1, len(d.agents[spoke.Name]), got.ResourceVersion)
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		return fmt.Errorf("framework: waiting for the agents of %s to see ServiceAccount %s/%s at resourceVersion %s (last seen: %s): %w",
			spoke.Name, sa.Namespace, sa.Name, sa.ResourceVersion, last, err)
	}
	return nil
}

// AgentRules are the spoke permissions an agent needs, as
// deploy/spoke/rbac.yaml grants them: list and watch ServiceAccounts (an
// informer, for their opt-in annotation; never a get), create tokens for them, and create, annotate, delete, list
// and watch the grant Secrets the tokens are bound to, and ask
// SubjectAccessReviews, to refuse ServiceAccounts that may escalate.
func AgentRules() []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"serviceaccounts"}, Verbs: []string{"list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"serviceaccounts/token"}, Verbs: []string{"create"}},
		{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"create", "patch", "delete", "list", "watch"}},
		{APIGroups: []string{"authorization.k8s.io"}, Resources: []string{"subjectaccessreviews"}, Verbs: []string{"create"}},
	}
}

// ClusterProfile returns the hub's ClusterProfile of spoke.
func (d *Deployment) ClusterProfile(ctx context.Context, spoke *Cluster) (*v1alpha1.ClusterProfile, error) {
	return d.Env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(FleetNamespace).Get(ctx, spoke.Name, metav1.GetOptions{})
}

func (d *Deployment) run(name string, fn func(context.Context) error) {
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		if err := fn(d.ctx); err != nil {
			d.mu.Lock()
			d.errs = append(d.errs, fmt.Errorf("%s: %w", name, err))
			d.mu.Unlock()
		}
	}()
}

// Stop stops the agents and the broker and returns the errors they ended
// with. It is safe to call more than once.
func (d *Deployment) Stop() error {
	if d.stop != nil {
		d.stop()
	}
	d.wg.Wait()
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.auditClosers {
		if err := c.Close(); err != nil {
			d.errs = append(d.errs, err)
		}
	}
	d.auditClosers = nil
	return errors.Join(d.errs...)
}
