package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"

	"github.com/credbroker/credbroker/internal/testing/testpki"
	"github.com/credbroker/credbroker/pkg/client"
	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/pkg/spoke"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// Who the story is about.
const (
	// hubAudience is the audience of the consumer's hub token: the broker's
	// default --audience, which a projected volume would ask for.
	hubAudience = "credbroker"

	consumerNamespace = "argocd"
	consumerName      = "application-controller"
	// outsiderName is a second hub ServiceAccount in consumerNamespace, with
	// no RBAC for clusterprofiles/token.
	outsiderName = "notifications-controller"

	spokeNamespace = "team-a"
	spokeAccount   = "deployer"

	// systemNamespace holds the broker's ServiceAccount on the hub and the
	// agent's on each spoke, as deploy/ does.
	systemNamespace = "credbroker-system"
	brokerAccount   = "broker"
	agentAccount    = "credbroker-agent"
	// connectedCondition is the condition the broker keeps on each
	// ClusterProfile it publishes.
	connectedCondition = "CredentialBrokerConnected"

	spokes = 2
	indent = "      "
)

// errUsage is returned by parseFlags once the flag package has reported the
// problem.
var errUsage = errors.New("usage")

type config struct {
	// plugin, cli, broker and agent are the absolute paths of the
	// credbroker-plugin, credbroker, broker and spoke-agent binaries;
	// kubectl is the one hack/testbin.sh builds.
	plugin, cli, broker, agent, kubectl string
	// deploy is the repository's deploy/ folder, whose RBAC the broker and
	// the agents get.
	deploy string
	// keep waits for Ctrl-C after the story instead of exiting.
	keep bool
	// out receives the story.
	out io.Writer
}

func main() {
	cfg, err := parseFlags(os.Args[1:])
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case errors.Is(err, errUsage):
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// After the first signal, run cleans up, which takes a while when API
	// servers are starting; a second signal ends the demo at once (the API
	// servers still get SIGTERM when it dies, but their files stay behind).
	context.AfterFunc(ctx, stop)
	err = run(ctx, cfg)
	interrupted := ctx.Err() != nil
	stop()
	switch {
	case err == nil:
	case interrupted:
		if !errors.Is(err, context.Canceled) {
			fmt.Fprintln(os.Stderr, "demo:", err)
		}
		os.Exit(130)
	default:
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (config, error) {
	cfg := config{out: os.Stdout}
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.StringVar(&cfg.plugin, "plugin", "", "`path` of the credbroker-plugin binary (required; \"make build\" writes bin/credbroker-plugin)")
	fs.StringVar(&cfg.cli, "cli", "", "`path` of the credbroker binary (required; \"make build\" writes bin/credbroker)")
	fs.StringVar(&cfg.broker, "broker", "", "`path` of the broker binary (required; \"make build\" writes bin/broker)")
	fs.StringVar(&cfg.agent, "agent", "", "`path` of the spoke-agent binary (required; \"make build\" writes bin/spoke-agent)")
	fs.StringVar(&cfg.deploy, "deploy", "deploy", "`folder` of the repository's deploy manifests, whose RBAC the broker and the agents get")
	fs.BoolVar(&cfg.keep, "keep", false, "after the story, keep the hub, the spokes, the broker and the agents running until Ctrl-C, and print kubeconfigs to look around")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return cfg, err
		}
		return cfg, errUsage
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var err error
	for _, b := range []struct {
		flag, built string
		path        *string
	}{
		{"--plugin", "bin/credbroker-plugin", &cfg.plugin},
		{"--cli", "bin/credbroker", &cfg.cli},
		{"--broker", "bin/broker", &cfg.broker},
		{"--agent", "bin/spoke-agent", &cfg.agent},
	} {
		if *b.path, err = executable(b.flag, *b.path, b.built); err != nil {
			return cfg, err
		}
	}
	if cfg.deploy, err = filepath.Abs(cfg.deploy); err != nil {
		return cfg, fmt.Errorf("--deploy: %w", err)
	}
	if _, err := os.Stat(filepath.Join(cfg.deploy, "hub", "rbac.yaml")); err != nil {
		return cfg, fmt.Errorf("--deploy: %w (run the demo from the repository's root, or name its deploy folder)", err)
	}
	return cfg, nil
}

// executable returns the absolute path of the binary that flag names, or
// says how to build it ("make build" writes built).
func executable(flag, path, built string) (string, error) {
	if path == "" {
		return "", fmt.Errorf(`%s is required: the path of %s ("make build" writes %s)`, flag, filepath.Base(built), built)
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("%s: %w", flag, err)
	}
	fi, err := os.Stat(abs)
	if err != nil {
		return "", fmt.Errorf(`%s: %w (run "make build" first)`, flag, err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return "", fmt.Errorf("%s: %s is not an executable file", flag, path)
	}
	return abs, nil
}

// demo holds what the story has built so far.
type demo struct {
	config
	dir string // temporary; removed on exit

	env    *framework.Env
	hub    *framework.Cluster
	spokes []*framework.Cluster
	ca     *testpki.CA
	caFile string // the CA that verifies the broker's exchange port

	exchangeAddr, agentAddr string
	procs                   []*process
	logs                    lines // every line the broker and the agents wrote

	hubToken, hubTokenFile string
	providerFile           string
	conn                   *grpc.ClientConn // to the broker's TokenExchange
	exchange               pb.TokenExchangeClient
}

// run tells the story, then cleans up whatever it started, however it ends:
// when ctx ends, it says so at once and cleans up.
func run(ctx context.Context, cfg config) (err error) {
	if cfg.kubectl, err = framework.Kubectl(); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "credbroker-demo-")
	if err != nil {
		return err
	}
	d := &demo{config: cfg, dir: dir}
	noticed := make(chan struct{})
	stopNotice := context.AfterFunc(ctx, func() {
		defer close(noticed)
		fmt.Fprintln(d.out, "\ninterrupted: stopping what was started (press Ctrl-C again to quit at once)")
	})
	defer func() {
		if !stopNotice() {
			<-noticed
		}
		err = errors.Join(err, d.cleanUp())
	}()

	story := []struct {
		title string
		do    func(context.Context) error
	}{
		{"starting a hub and two spokes (etcd + kube-apiserver each)", d.startClusters},
		{"starting the broker against the hub: bin/broker, with the RBAC of deploy/hub and --publish-access-provider", d.startBroker},
		{"starting an agent on each spoke: bin/spoke-agent, which dials out to the broker and advertises its spoke", d.startAgents},
		{fmt.Sprintf("on the hub: the consumer %s/%s, allowed to ask for both spokes", consumerNamespace, consumerName), d.createConsumer},
		{fmt.Sprintf("minting the consumer's hub token for audience %q, as a projected volume would", hubAudience), d.mintHubToken},
		{fmt.Sprintf("on each spoke: %s/%s, which opts in to that consumer", spokeNamespace, spokeAccount), d.createSpokeAccounts},
		{"the consumer lists namespaces through cluster-inventory-api's pkg/access and credbroker-plugin", d.useAccess},
		{"the consumer lists namespaces through the Go client, pkg/client", d.useGoClient},
		{"a person lists namespaces with kubectl and a kubeconfig from `credbroker kubeconfig`", d.useKubectl},
		{"a hub ServiceAccount without RBAC asks too", d.showRefusal},
		{fmt.Sprintf("the admin of %s traces a request to the consumer, and the consumer's token is revoked", d.firstSpokeName()), d.traceAndRevoke},
		{"what the hub keeps", d.showHubState},
	}
	began := time.Now()
	for i, step := range story {
		fmt.Fprintf(d.out, "[%d/%d] %s…\n", i+1, len(story), step.title)
		stepBegan := time.Now()
		if err := step.do(ctx); err != nil {
			return err
		}
		d.say("done in %s", round(time.Since(stepBegan)))
	}
	fmt.Fprintf(d.out, "the story took %s: the consumer used both spokes with tokens minted there, and the hub never held one.\n",
		round(time.Since(began)))

	if d.keep {
		return d.keepRunning(ctx)
	}
	return nil
}

func (d *demo) firstSpokeName() string { return framework.SpokeName(1) }

// 1. Three clusters, each with its own etcd, CA and service account issuer.
func (d *demo) startClusters(ctx context.Context) error {
	env, err := framework.Start(ctx, framework.Options{Spokes: spokes})
	if err != nil {
		return err // names `make testbin` when the binaries are missing
	}
	d.env, d.hub, d.spokes = env, env.Hub, env.Spokes
	for _, c := range env.Clusters() {
		d.say("%-8s %s  service account issuer %s", c.Name, c.Server, c.Issuer)
	}
	return nil
}

// 2. The broker, a process with the flags a user would pass, as the hub
// ServiceAccount that deploy/hub creates and with exactly its RBAC; and a
// ClusterProfile per spoke, with no access provider: the broker publishes
// them once the agents connect.
func (d *demo) startBroker(ctx context.Context) error {
	pki := filepath.Join(d.dir, "pki")
	if err := os.Mkdir(pki, 0o700); err != nil {
		return err
	}
	ca, err := testpki.NewCA(framework.TrustDomain)
	if err != nil {
		return err
	}
	d.ca = ca
	if d.caFile, err = ca.WriteBundle(pki); err != nil {
		return err
	}
	tlsCert, tlsKey, err := ca.WriteServing(pki, "127.0.0.1", "localhost")
	if err != nil {
		return err
	}
	svidCert, svidKey, err := ca.WriteSVID(pki, framework.BrokerID())
	if err != nil {
		return err
	}

	// deploy/hub's ServiceAccount and RBAC, with the publishing
	// component's, applied with kubectl as an admin would.
	if err := d.hub.EnsureNamespace(ctx, systemNamespace); err != nil {
		return err
	}
	files := []string{filepath.Join(d.deploy, "hub", "rbac.yaml"), filepath.Join(d.deploy, "components", "publish-access-provider", "rbac.yaml")}
	if err := d.kubectlApply(ctx, d.hub, files...); err != nil {
		return err
	}
	kubeconfig, err := d.serviceAccountKubeconfig(ctx, d.hub, systemNamespace, brokerAccount)
	if err != nil {
		return err
	}
	d.say("hub ServiceAccount %s/%s with the RBAC of deploy/hub/rbac.yaml and deploy/components/publish-access-provider/rbac.yaml", systemNamespace, brokerAccount)

	for _, s := range d.spokes {
		if _, err := d.hub.CreateClusterProfile(ctx, framework.FleetNamespace, s.Name, nil); err != nil {
			return err
		}
	}
	d.say("ClusterProfiles %s/%s and %s/%s on the hub, with no access provider and no credential",
		framework.FleetNamespace, d.spokes[0].Name, framework.FleetNamespace, d.spokes[1].Name)

	addrs, err := freeAddrs(3)
	if err != nil {
		return err
	}
	d.exchangeAddr, d.agentAddr = addrs[0], addrs[1]
	args := []string{
		"--kubeconfig=" + kubeconfig,
		"--exchange-address=" + d.exchangeAddr,
		"--agent-address=" + d.agentAddr,
		"--metrics-address=" + addrs[2],
		"--tls-cert-file=" + tlsCert, "--tls-key-file=" + tlsKey,
		"--svid-cert-file=" + svidCert, "--svid-key-file=" + svidKey, "--trust-bundle-file=" + d.caFile,
		"--trust-domain=" + framework.TrustDomain,
		"--publish-access-provider=true",
		"--publish-lease-namespace=" + systemNamespace,
		"--publish-identity=broker-0",
		"--shutdown-grace=2s", "--shutdown-delay=0s",
		// The demo starts its agents once the broker is ready; a replica
		// that starts beside others waits for their agents instead.
		"--agent-reconnect-window=0s",
	}
	d.say("$ broker %s", strings.Join(d.short(args), " "))
	if err := d.start(ctx, "broker", d.broker, args); err != nil {
		return err
	}
	if err := waitReady(ctx, "broker", "http://"+addrs[2]+"/readyz"); err != nil {
		return err
	}
	d.say("ready: TokenExchange for consumers (TLS) on %s, AgentTunnel for agents (SPIFFE mTLS) on %s", d.exchangeAddr, d.agentAddr)
	return nil
}

// 3. The agents: on each spoke, the only thing that can mint tokens for
// others, as the ServiceAccount that deploy/spoke creates.
func (d *demo) startAgents(ctx context.Context) error {
	// The metrics ports of every agent at once: a port picked after the
	// first agent starts may be the one it is about to bind.
	metricsAddrs, err := freeAddrs(len(d.spokes))
	if err != nil {
		return err
	}
	for i, s := range d.spokes {
		if err := s.EnsureNamespace(ctx, systemNamespace); err != nil {
			return err
		}
		if err := d.kubectlApply(ctx, s, filepath.Join(d.deploy, "spoke", "rbac.yaml")); err != nil {
			return err
		}
		kubeconfig, err := d.serviceAccountKubeconfig(ctx, s, systemNamespace, agentAccount)
		if err != nil {
			return err
		}
		dir := filepath.Join(d.dir, "agent-"+s.Name)
		if err := os.Mkdir(dir, 0o700); err != nil {
			return err
		}
		id := framework.AgentID(s.Name)
		cert, key, err := d.ca.WriteSVID(dir, id)
		if err != nil {
			return err
		}
		// What the hub should use to reach this spoke: the agent reports it,
		// and never guesses it.
		advertisedCA := filepath.Join(dir, "spoke-ca.crt")
		if err := os.WriteFile(advertisedCA, s.CAData, 0o600); err != nil {
			return err
		}
		args := []string{
			"--kubeconfig=" + kubeconfig,
			"--broker-address=" + d.agentAddr,
			"--trust-domain=" + framework.TrustDomain,
			"--svid-cert-file=" + cert, "--svid-key-file=" + key, "--trust-bundle-file=" + d.caFile,
			"--cluster=" + framework.FleetNamespace + "/" + s.Name,
			"--advertise-server=" + s.Server,
			"--advertise-ca-file=" + advertisedCA,
			"--metrics-address=" + metricsAddrs[i],
			"--shutdown-grace=2s",
		}
		d.say("%s: ServiceAccount %s/%s with the RBAC of deploy/spoke/rbac.yaml; SVID %s", s.Name, systemNamespace, agentAccount, id)
		d.say("  $ spoke-agent %s", strings.Join(d.short(args), " "))
		if err := d.start(ctx, "agent "+s.Name, d.agent, args); err != nil {
			return err
		}
	}
	// The broker publishes each spoke's access provider once its agent is
	// connected.
	for _, s := range d.spokes {
		cp, err := d.waitPublished(ctx, s)
		if err != nil {
			return err
		}
		for _, p := range cp.Status.AccessProviders {
			d.say("ClusterProfile %s/%s: the broker published access provider %q: server %s, CA %d bytes of PEM",
				cp.Namespace, cp.Name, p.Name, p.Cluster.Server, len(p.Cluster.CertificateAuthorityData))
			for _, ext := range p.Cluster.Extensions {
				d.say("  extension %s: %s", ext.Name, ext.Extension.Raw)
			}
		}
		for _, c := range cp.Status.Conditions {
			if c.Type == connectedCondition {
				d.say("  condition %s=%s (%s)", c.Type, c.Status, c.Reason)
			}
		}
	}
	return nil
}

// waitPublished waits until the broker has published spoke's access
// provider and says its agent is connected.
func (d *demo) waitPublished(ctx context.Context, s *framework.Cluster) (*v1alpha1.ClusterProfile, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	profiles := d.hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace)
	for {
		cp, err := profiles.Get(ctx, s.Name, metav1.GetOptions{})
		if err == nil && published(cp, s.Server) {
			return cp, nil
		}
		last := fmt.Sprintf("error %v", err)
		if err == nil {
			var seen []string
			for _, p := range cp.Status.AccessProviders {
				seen = append(seen, "access provider "+p.Name+": "+p.Cluster.Server)
			}
			for _, c := range cp.Status.Conditions {
				seen = append(seen, fmt.Sprintf("condition %s=%s (%s)", c.Type, c.Status, c.Reason))
			}
			last = strings.Join(seen, "; ")
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("the broker did not publish the access provider of %s in 30s (last seen: %s); its log:\n%s",
				s.Name, last, strings.Join(d.logs.all(), "\n"))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func published(cp *v1alpha1.ClusterProfile, server string) bool {
	ok := false
	for _, p := range cp.Status.AccessProviders {
		ok = ok || (p.Name == plugin.Name && p.Cluster.Server == server)
	}
	for _, c := range cp.Status.Conditions {
		if c.Type == connectedCondition {
			return ok && c.Status == metav1.ConditionTrue
		}
	}
	return false
}

// kubectlApply applies manifest files to c with kubectl, as its admin.
func (d *demo) kubectlApply(ctx context.Context, c *framework.Cluster, files ...string) error {
	kubeconfig, err := c.WriteKubeconfig(d.dir)
	if err != nil {
		return err
	}
	args := []string{"--kubeconfig=" + kubeconfig, "apply", "--namespace=" + systemNamespace}
	for _, f := range files {
		args = append(args, "--filename="+f)
	}
	if out, err := exec.CommandContext(ctx, d.kubectl, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("kubectl apply on %s: %w\n%s", c.Name, err, out)
	}
	return nil
}

// serviceAccountKubeconfig writes a kubeconfig for c that authenticates as
// the ServiceAccount namespace/name with a token of an hour, as a pod's
// would, and returns its path.
func (d *demo) serviceAccountKubeconfig(ctx context.Context, c *framework.Cluster, namespace, name string) (string, error) {
	tok, err := c.Token(ctx, namespace, name, nil, time.Hour)
	if err != nil {
		return "", err
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[c.Name] = &clientcmdapi.Cluster{Server: c.Server, CertificateAuthorityData: c.CAData}
	cfg.AuthInfos[name] = &clientcmdapi.AuthInfo{Token: tok}
	cfg.Contexts[c.Name] = &clientcmdapi.Context{Cluster: c.Name, AuthInfo: name}
	cfg.CurrentContext = c.Name
	path := filepath.Join(d.dir, c.Name+"-"+name+".kubeconfig")
	return path, clientcmd.WriteToFile(*cfg, path)
}

// short shortens the demo's temporary folder in arguments, for display.
func (d *demo) short(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = strings.ReplaceAll(a, d.dir, "$DEMO")
	}
	return out
}

// process is a binary the demo started; its output goes to the demo's
// logs.
type process struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// start runs bin with args until cleanUp.
func (d *demo) start(ctx context.Context, name, bin string, args []string) error {
	cmd := exec.Command(bin, args...)
	out, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	cmd.Stdout = cmd.Stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, done: make(chan struct{})}
	d.procs = append(d.procs, p)
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			d.logs.add(name + ": " + sc.Text())
		}
		p.err = cmd.Wait()
		close(p.done)
	}()
	select {
	case <-p.done:
		return fmt.Errorf("%s stopped at once (%v); its output:\n%s", name, p.err, strings.Join(d.logs.all(), "\n"))
	case <-time.After(50 * time.Millisecond):
		return ctx.Err()
	}
}

// stop sends SIGTERM and waits for the process to drain and end, or kills
// it after 10s.
func (p *process) stop() error {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s did not stop within 10s of SIGTERM", p.name)
	}
	if p.err != nil {
		return fmt.Errorf("%s ended with %w after SIGTERM", p.name, p.err)
	}
	return nil
}

// freeAddrs returns n loopback addresses with ports free now.
func freeAddrs(n int) ([]string, error) {
	var addrs []string
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			_ = l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		addrs = append(addrs, l.Addr().String())
	}
	return addrs, nil
}

// waitReady polls url until it answers 200, for 30s.
func waitReady(ctx context.Context, name, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var last string
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("%s: %s", resp.Status, body)
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s is not ready at %s after 30s (last answer: %s)", name, url, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// 4. The hub decides who may ask for a spoke: RBAC on clusterprofiles/token.
func (d *demo) createConsumer(ctx context.Context) error {
	if _, err := d.hub.CreateServiceAccount(ctx, consumerNamespace, consumerName, nil); err != nil {
		return err
	}
	for _, s := range d.spokes {
		if err := d.hub.GrantClusterProfileToken(ctx, framework.FleetNamespace, s.Name, consumerNamespace, consumerName); err != nil {
			return err
		}
		d.say("Role and RoleBinding in namespace %s: %s",
			framework.FleetNamespace, describeRule(framework.ClusterProfileTokenRule(s.Name)))
	}
	d.say("ServiceAccount %s/%s, user %s", consumerNamespace, consumerName, consumerUser())
	return nil
}

// 5. What the kubelet would put in the consumer pod: a hub token bound to
// the broker's audience.
func (d *demo) mintHubToken(ctx context.Context) error {
	tok, err := d.hub.Token(ctx, consumerNamespace, consumerName, []string{hubAudience}, time.Hour)
	if err != nil {
		return err
	}
	d.hubToken, d.hubTokenFile = tok, filepath.Join(d.dir, "hub-token")
	if err := os.WriteFile(d.hubTokenFile, []byte(tok), 0o600); err != nil {
		return err
	}
	expiry, _ := token.Expiry(tok)
	d.say("hub token %s, audience %q, expires in %d min", token.Fingerprint(tok), hubAudience, int(time.Until(expiry).Round(time.Minute).Minutes()))
	d.say("written to %s", d.hubTokenFile)

	for _, s := range d.spokes {
		review, err := s.ReviewToken(ctx, tok, nil)
		if err != nil {
			return err
		}
		if review.Authenticated {
			return fmt.Errorf("%s accepted the hub token", s.Name)
		}
	}
	d.say("both spokes reject it (TokenReview: authenticated=false): it is good for the broker only")
	return nil
}

// 6. The spoke decides what the consumer gets: a ServiceAccount that opts
// in, with the spoke's own RBAC.
func (d *demo) createSpokeAccounts(ctx context.Context) error {
	if err := d.dialBroker(ctx); err != nil {
		return err
	}
	rules := []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}}}
	for _, s := range d.spokes {
		// The consumer may name the spoke API server's own audience (its
		// issuer), which the timings below ask for; without the audiences
		// annotation it could get only a token for the default audiences,
		// requested by naming none.
		annotations := map[string]string{
			spoke.AllowedSubjectsAnnotation:  consumerUser(),
			spoke.AllowedAudiencesAnnotation: s.Issuer,
		}
		if _, err := s.CreateServiceAccount(ctx, spokeNamespace, spokeAccount, annotations); err != nil {
			return err
		}
		if err := s.Grant(ctx, "", framework.ServiceAccountSubject(spokeNamespace, spokeAccount), rules); err != nil {
			return err
		}
		d.say("%s: ServiceAccount %s/%s", s.Name, spokeNamespace, spokeAccount)
		d.say("  annotation %s=%s", spoke.AllowedSubjectsAnnotation, consumerUser())
		d.say("  annotation %s=%s", spoke.AllowedAudiencesAnnotation, s.Issuer)
		for _, rule := range rules {
			d.say("  ClusterRole and ClusterRoleBinding: %s", describeRule(rule))
		}
	}
	// The agents read the annotation from their informers: wait until an
	// exchange for each spoke succeeds.
	for _, s := range d.spokes {
		if err := d.waitServed(ctx, s); err != nil {
			return err
		}
	}
	return nil
}

// waitServed waits until the broker answers the consumer a token for s.
func (d *demo) waitServed(ctx context.Context, s *framework.Cluster) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		_, err := d.exchange.Exchange(withBearer(ctx, d.hubToken), &pb.ExchangeRequest{Cluster: clusterRef(s)})
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the broker does not serve %s after 30s: %w", s.Name, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// 7. A hub controller that uses cluster-inventory-api: a provider file, the
// ClusterProfile as the broker published it, and client-go.
func (d *demo) useAccess(ctx context.Context) error {
	providers, err := d.writeProviderFile()
	if err != nil {
		return err
	}
	for i, s := range d.spokes {
		cp, err := d.hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Get(ctx, s.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		restConfig, err := providers.BuildConfigFromCP(cp)
		if err != nil {
			return err
		}
		if restConfig.ExecProvider == nil {
			return fmt.Errorf("access.BuildConfigFromCP(%s/%s) set no exec plugin", cp.Namespace, cp.Name)
		}
		d.say("access.BuildConfigFromCP(%s/%s): host %s, exec %s, no token in it",
			cp.Namespace, cp.Name, restConfig.Host, filepath.Base(restConfig.ExecProvider.Command))
		began := time.Now()
		if err := d.listNamespaces(ctx, s, restConfig); err != nil {
			return err
		}
		d.say("  (%s for the first request, running the plugin and the exchange included)", round(time.Since(began)))
		if i == 0 {
			if err := d.whoAmI(ctx, s, restConfig); err != nil {
				return err
			}
		}
	}
	return d.timeExchanges(ctx, d.spokes[0])
}

// listNamespaces lists the namespaces of s through restConfig and says
// which.
func (d *demo) listNamespaces(ctx context.Context, s *framework.Cluster, restConfig *rest.Config) error {
	cs, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}
	list, err := cs.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("list namespaces on %s: %w", s.Name, err)
	}
	names := make([]string, 0, len(list.Items))
	for _, ns := range list.Items {
		names = append(names, ns.Name)
	}
	d.say("namespaces on %s: %s", s.Name, strings.Join(names, ", "))
	return nil
}

// whoAmI checks that s authenticates the consumer as the spoke
// ServiceAccount that opted in.
func (d *demo) whoAmI(ctx context.Context, s *framework.Cluster, restConfig *rest.Config) error {
	cs, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}
	self, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	want, _ := framework.ServiceAccountUser(spokeNamespace, spokeAccount)
	if got := self.Status.UserInfo.Username; got != want {
		return fmt.Errorf("%s authenticated the consumer as %q, want %q", s.Name, got, want)
	}
	d.say("  authenticated on %s as %s", s.Name, self.Status.UserInfo.Username)
	return nil
}

// writeProviderFile writes the cluster-inventory-api provider file that a
// consumer ships: which exec plugin serves the access provider "credbroker".
// Everything else (server, CA, which ClusterProfile) comes from the
// ClusterProfile that the broker published.
func (d *demo) writeProviderFile() (*access.Config, error) {
	args := []string{
		"--broker-address=" + d.exchangeAddr,
		"--ca-file=" + d.caFile,
		"--token-file=" + d.hubTokenFile,
	}
	providers := access.Config{Providers: []access.Provider{{
		Name: plugin.Name,
		ExecConfig: &clientcmdapi.ExecConfig{
			APIVersion:         "client.authentication.k8s.io/v1",
			Command:            d.plugin,
			Args:               args,
			ProvideClusterInfo: true,
		},
	}}}
	data, err := json.MarshalIndent(providers, "", "  ")
	if err != nil {
		return nil, err
	}
	d.providerFile = filepath.Join(d.dir, "providers.json")
	if err := os.WriteFile(d.providerFile, data, 0o600); err != nil {
		return nil, err
	}
	d.say("provider file %s: provider %q runs", d.providerFile, plugin.Name)
	d.say("  %s %s", d.plugin, strings.Join(d.short(args), " "))
	return access.NewFromFile(d.providerFile)
}

// timeExchanges times, once each, an exchange that the broker mints through
// the agent, the same exchange again (from the broker's cache), and a direct
// TokenRequest on the spoke. It is a display, not a benchmark: see `make
// bench` for that.
func (d *demo) timeExchanges(ctx context.Context, s *framework.Cluster) error {
	// The plugin asked for the spoke's default audiences; naming them makes a
	// new cache key, so the first call below is minted on the spoke.
	audiences := []string{s.Issuer}
	req := &pb.ExchangeRequest{Cluster: clusterRef(s), Audiences: audiences}
	call := func() (*pb.ExchangeResponse, error) { return d.exchange.Exchange(withBearer(ctx, d.hubToken), req) }

	cold, coldTook, err := timed(call)
	if err != nil {
		return fmt.Errorf("exchange: %w", err)
	}
	cached, cachedTook, err := timed(call)
	if err != nil {
		return fmt.Errorf("exchange: %w", err)
	}
	_, directTook, err := timed(func() (string, error) {
		return s.Token(ctx, spokeNamespace, spokeAccount, audiences, time.Hour)
	})
	if err != nil {
		return err
	}

	same := "a new credential"
	if cached.GetCredentialId() == cold.GetCredentialId() {
		same = "the same credential"
	}
	sa := cold.GetServiceAccount()
	d.say("timings, one call each over warm connections (a display, not a benchmark):")
	d.say("  %-9s exchange, cold: a new audience, so the agent mints on %s (%s/%s, %s)",
		round(coldTook), s.Name, sa.GetNamespace(), sa.GetName(), cold.GetCredentialId())
	d.say("  %-9s exchange, cached: %s, from the broker's cache", round(cachedTook), same)
	d.say("  %-9s TokenRequest directly on %s, as its admin", round(directTook), s.Name)
	return nil
}

// 8. A hub controller in Go: no plugin, no provider file; the broker
// answers the server and CA with the token.
func (d *demo) useGoClient(ctx context.Context) error {
	roots := x509.NewCertPool()
	pem, err := os.ReadFile(d.caFile)
	if err != nil {
		return err
	}
	roots.AppendCertsFromPEM(pem)
	source, err := client.NewFileTokenSource(d.hubTokenFile, 0, nil)
	if err != nil {
		return err
	}
	gc, err := client.New(client.Config{
		Address:     d.exchangeAddr,
		TLS:         &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
		TokenSource: source,
	})
	if err != nil {
		return err
	}
	defer gc.Close()
	d.say("client.New(client.Config{Address: %q, TLS: <the broker's CA>, TokenSource: client.NewFileTokenSource(%q, …)})",
		d.exchangeAddr, d.short([]string{d.hubTokenFile})[0])
	for _, s := range d.spokes {
		restConfig, err := gc.RESTConfigFor(ctx, framework.FleetNamespace, s.Name)
		if err != nil {
			return err
		}
		d.say("RESTConfigFor(ctx, %q, %q): host %s, bearer token in the config: %t",
			framework.FleetNamespace, s.Name, restConfig.Host, restConfig.BearerToken != "")
		if err := d.listNamespaces(ctx, s, restConfig); err != nil {
			return err
		}
	}
	return nil
}

// 9. A person, or a script: a kubeconfig that runs credbroker-plugin, and
// the kubectl of the API servers' version.
func (d *demo) useKubectl(ctx context.Context) error {
	for _, s := range d.spokes {
		kubeconfig := filepath.Join(d.dir, s.Name+"-consumer.kubeconfig")
		args := []string{"kubeconfig", "--cluster=" + framework.FleetNamespace + "/" + s.Name,
			"--broker-address=" + d.exchangeAddr, "--ca-file=" + d.caFile, "--token-file=" + d.hubTokenFile,
			"--plugin-path=" + d.plugin, "--output=" + kubeconfig}
		d.say("$ credbroker %s", strings.Join(d.short(args), " "))
		if out, err := exec.CommandContext(ctx, d.cli, args...).CombinedOutput(); err != nil {
			return fmt.Errorf("credbroker kubeconfig: %w\n%s", err, out)
		}
		cfg, err := clientcmd.LoadFromFile(kubeconfig)
		if err != nil {
			return err
		}
		cur := cfg.Contexts[cfg.CurrentContext]
		if cur == nil || cfg.Clusters[cur.Cluster] == nil || cfg.AuthInfos[cur.AuthInfo] == nil || cfg.AuthInfos[cur.AuthInfo].Exec == nil {
			return fmt.Errorf("credbroker kubeconfig wrote no current context with an exec user to %s", kubeconfig)
		}
		if cfg.AuthInfos[cur.AuthInfo].Token != "" {
			return fmt.Errorf("credbroker kubeconfig wrote a token into %s", kubeconfig)
		}
		d.say("  server %s, user execs %s, no token in it", cfg.Clusters[cur.Cluster].Server, filepath.Base(cfg.AuthInfos[cur.AuthInfo].Exec.Command))
		kargs := []string{"--kubeconfig=" + kubeconfig, "get", "namespaces", "--output=name"}
		d.say("$ kubectl %s", strings.Join(d.short(kargs), " "))
		out, err := exec.CommandContext(ctx, d.kubectl, kargs...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("kubectl get namespaces on %s: %w\n%s", s.Name, err, out)
		}
		d.say("  %s", strings.Join(strings.Fields(string(out)), " "))
	}
	return nil
}

// 10. A valid hub token is not enough: the hub's RBAC must allow the spoke.
func (d *demo) showRefusal(ctx context.Context) error {
	if _, err := d.hub.CreateServiceAccount(ctx, consumerNamespace, outsiderName, nil); err != nil {
		return err
	}
	tok, err := d.hub.Token(ctx, consumerNamespace, outsiderName, []string{hubAudience}, time.Hour)
	if err != nil {
		return err
	}
	d.say("ServiceAccount %s/%s: a valid hub token %s for %q, no RBAC for clusterprofiles/token",
		consumerNamespace, outsiderName, token.Fingerprint(tok), hubAudience)
	_, err = d.exchange.Exchange(withBearer(ctx, tok), &pb.ExchangeRequest{Cluster: clusterRef(d.spokes[0])})
	st := status.Convert(err)
	if st.Code() != codes.PermissionDenied {
		return fmt.Errorf("exchange without RBAC: got %s (%q), want PermissionDenied", st.Code(), st.Message())
	}
	d.say("refused: %s", st.Code())
	d.say("message: %s", st.Message())
	return nil
}

// 11. Any request the spoke audited names its hub consumer, and a revoke
// reaches a token already in the consumer's hands.
func (d *demo) traceAndRevoke(ctx context.Context) error {
	s := d.spokes[0]
	resp, err := d.exchange.Exchange(withBearer(ctx, d.hubToken), &pb.ExchangeRequest{Cluster: clusterRef(s)})
	if err != nil {
		return fmt.Errorf("exchange: %w", err)
	}
	tok := resp.GetToken()
	selfReview := func() error {
		client, err := kubernetes.NewForConfig(s.TokenConfig(tok))
		if err != nil {
			return err
		}
		_, err = client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
		return err
	}
	if err := selfReview(); err != nil {
		return err
	}

	// The spoke's audit log records the request with the token's
	// credential id; the grant with that id names the consumer.
	var audited string
	for deadline := time.Now().Add(10 * time.Second); audited == "" && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		events, err := s.AuditEvents(func(ev framework.AuditEvent) bool {
			return slices.Contains(ev.User.Extra[framework.CredentialIDExtra], resp.GetCredentialId())
		})
		if err != nil {
			return err
		}
		if len(events) > 0 {
			audited = events[len(events)-1].User.Extra[framework.CredentialIDExtra][0]
			d.say("the spoke's audit log: %s %s by %s, credential id %s",
				events[len(events)-1].Verb, events[len(events)-1].RequestURI, events[len(events)-1].User.Username, audited)
		}
	}
	if audited == "" {
		return fmt.Errorf("the spoke's audit log %s has no event with credential id %s after 10s", s.AuditLog, resp.GetCredentialId())
	}
	jti, _ := strings.CutPrefix(audited, "JTI=")
	selector := spoke.GrantJTILabel + "=" + jti
	// A token minted on a pooled grant is answered before the claim that
	// labels its grant lands: give the claim a few seconds.
	var grants *corev1.SecretList
	for wait := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if grants, err = s.Client.CoreV1().Secrets(metav1.NamespaceAll).List(ctx, metav1.ListOptions{LabelSelector: selector}); err != nil {
			return err
		}
		if len(grants.Items) > 0 || time.Now().After(wait) {
			break
		}
	}
	if len(grants.Items) != 1 {
		return fmt.Errorf("kubectl get secrets -A -l %s: %d grants, want 1", selector, len(grants.Items))
	}
	g := grants.Items[0]
	d.say("kubectl get secrets -A -l %s: grant %s/%s, for hub consumer %s through ClusterProfile %s",
		selector, g.Namespace, g.Name, g.Annotations[spoke.GrantHubUserAnnotation], g.Annotations[spoke.GrantClusterProfileAnnotation])

	// The consumer revokes its own token with the people's CLI.
	args := []string{"grants", "revoke", "--broker-address=" + d.exchangeAddr, "--ca-file=" + d.caFile,
		"--token-file=" + d.hubTokenFile, "--credential-id=" + audited, "--reason=demo: the token leaked"}
	d.say("$ credbroker %s", strings.Join(quoted(d.short(args)), " "))
	revoked := time.Now()
	out, err := exec.CommandContext(ctx, d.cli, args...).CombinedOutput()
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		d.say("  %s", line)
	}
	if err != nil {
		return fmt.Errorf("credbroker grants revoke: %w", err)
	}
	for {
		err := selfReview()
		if apierrors.IsUnauthorized(err) {
			break
		}
		if time.Since(revoked) > 30*time.Second {
			return fmt.Errorf("the spoke still accepts the revoked token after 30s (last answer: %v)", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	d.say("the spoke refuses the token %s after the revoke (its API server caches a token's authentication for 10 s)", round(time.Since(revoked)))
	return nil
}

// quoted quotes the arguments that a shell would split.
func quoted(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = a
		if strings.ContainsAny(a, " '\"") {
			out[i] = strconv.Quote(a)
		}
	}
	return out
}

// 12. The hub stores no spoke token, and the broker and the agents log
// none.
func (d *demo) showHubState(ctx context.Context) error {
	secrets, err := d.hub.Client.CoreV1().Secrets(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	issuers := map[string]bool{}
	for _, s := range d.spokes {
		issuers[s.Issuer] = true
	}
	holding := 0
	for _, s := range secrets.Items {
		for _, v := range s.Data {
			if slices.ContainsFunc(jwtIssuers(v), func(iss string) bool { return issuers[iss] }) {
				holding++
				break
			}
		}
	}
	d.say("Secrets on the hub, all namespaces: %d; holding a spoke token: %d", len(secrets.Items), holding)
	if holding > 0 {
		return fmt.Errorf("%d hub Secrets hold a spoke token", holding)
	}

	logs := d.logs.all()
	d.say("the broker's audit log, one line per call:")
	outcomes := map[string]bool{}
	for _, line := range logs {
		if rec, ok := auditRecord(line); ok {
			d.say("  %s", describeAudit(rec))
			outcomes[rec["msg"]+" "+rec["code"]] = true
		}
	}
	// The story made calls of each kind; each must have its line.
	for _, want := range []string{"exchange OK", "exchange PermissionDenied", "grants OK"} {
		if !outcomes[want] {
			return fmt.Errorf("the broker's audit log has no %q line: is it still writing JSON lines to stdout (--audit-log-path=-)?", want)
		}
	}
	tokens := len(jwtIssuers([]byte(strings.Join(logs, "\n"))))
	d.say("broker and agent logs: %d lines, %d tokens in them", len(logs), tokens)
	if tokens > 0 {
		return fmt.Errorf("the broker's or the agents' logs hold %d tokens", tokens)
	}
	return nil
}

// keepRunning prints admin kubeconfigs and waits for Ctrl-C.
func (d *demo) keepRunning(ctx context.Context) error {
	hubConfig, err := d.hub.WriteKubeconfig(d.dir)
	if err != nil {
		return err
	}
	fmt.Fprintln(d.out, "--keep: everything stays up until Ctrl-C. Admin kubeconfigs:")
	d.say("%-8s %s", d.hub.Name, hubConfig)
	for _, s := range d.spokes {
		spokeConfig, err := s.WriteKubeconfig(d.dir)
		if err != nil {
			return err
		}
		d.say("%-8s %s", s.Name, spokeConfig)
		d.say("  the consumer's: %s", filepath.Join(d.dir, s.Name+"-consumer.kubeconfig"))
	}
	d.say("for example:")
	d.say("  %s --kubeconfig %s get clusterprofile -n %s %s -o yaml", d.kubectl, hubConfig, framework.FleetNamespace, d.spokes[0].Name)
	d.say("the consumer's provider file: %s", d.providerFile)
	<-ctx.Done()
	return nil
}

// cleanUp stops the deployment, then the clusters, and removes the
// temporary folder. It is safe whatever step the story stopped at.
func (d *demo) cleanUp() error {
	var errs []error
	if d.env != nil {
		began := time.Now()
		fmt.Fprintln(d.out, "stopping the agents and the broker (SIGTERM), then the API servers…")
		if d.conn != nil {
			errs = append(errs, d.conn.Close())
		}
		// The agents first, then the broker, as a fleet would scale down.
		for _, p := range slices.Backward(d.procs) {
			errs = append(errs, p.stop())
		}
		errs = append(errs, d.env.Stop())
		d.say("done in %s", round(time.Since(began)))
	}
	errs = append(errs, os.RemoveAll(d.dir))
	return errors.Join(errs...)
}

// dialBroker connects to the broker's TokenExchange, verifying it with the
// deployment's CA, and waits until the connection is ready, so that timings
// leave the TLS handshake out.
func (d *demo) dialBroker(ctx context.Context) error {
	pem, err := os.ReadFile(d.caFile)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return fmt.Errorf("no certificate in %s", d.caFile)
	}
	addr := d.exchangeAddr
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})))
	if err != nil {
		return err
	}
	d.conn, d.exchange = conn, pb.NewTokenExchangeClient(conn)

	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn.Connect()
	for s := conn.GetState(); s != connectivity.Ready; s = conn.GetState() {
		if !conn.WaitForStateChange(ctx, s) {
			return fmt.Errorf("connect to the broker at %s (last state %s): %w", addr, s, ctx.Err())
		}
	}
	return nil
}

func clusterRef(s *framework.Cluster) *pb.ObjectReference {
	return &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: s.Name}
}

// say prints one indented line under the current step.
func (d *demo) say(format string, args ...any) {
	fmt.Fprint(d.out, indent)
	fmt.Fprintf(d.out, format, args...)
	fmt.Fprintln(d.out)
}

func consumerUser() string {
	user, _ := framework.ServiceAccountUser(consumerNamespace, consumerName)
	return user
}

func withBearer(ctx context.Context, tok string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
}

func timed[T any](f func() (T, error)) (T, time.Duration, error) {
	began := time.Now()
	v, err := f()
	return v, time.Since(began), err
}

func round(d time.Duration) time.Duration {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond)
	case d >= 10*time.Millisecond:
		return d.Round(time.Millisecond)
	default:
		return d.Round(10 * time.Microsecond)
	}
}

// describeRule says what an RBAC rule allows, in a line.
func describeRule(r rbacv1.PolicyRule) string {
	group := "core group"
	if g := strings.Join(r.APIGroups, ","); g != "" {
		group = "group " + g
	}
	s := fmt.Sprintf("%s %s (%s)", strings.Join(r.Verbs, ","), strings.Join(r.Resources, ","), group)
	if len(r.ResourceNames) > 0 {
		s += " named " + strings.Join(r.ResourceNames, ",")
	}
	return s
}

// auditRecord reads one of the broker's audit lines, the JSON objects it
// writes to standard output ("exchange" or "grants"), into strings.
func auditRecord(line string) (map[string]string, bool) {
	_, js, ok := strings.Cut(line, ": ")
	if !ok || !strings.HasPrefix(js, "{") {
		return nil, false
	}
	var raw map[string]any
	if json.Unmarshal([]byte(js), &raw) != nil {
		return nil, false
	}
	if msg, _ := raw["msg"].(string); msg != "exchange" && msg != "grants" {
		return nil, false
	}
	rec := map[string]string{}
	for k, v := range raw {
		switch v := v.(type) {
		case string:
			rec[k] = v
		case float64:
			if k == "latency" { // slog writes a time.Duration in nanoseconds
				rec[k] = time.Duration(v).String()
				continue
			}
			rec[k] = strconv.FormatFloat(v, 'f', -1, 64)
		default:
			b, _ := json.Marshal(v)
			rec[k] = string(b)
		}
	}
	return rec, true
}

// describeAudit shortens one of the broker's audit lines.
func describeAudit(rec map[string]string) string {
	outcome := "refused"
	cluster := rec["cluster"]
	switch {
	case rec["msg"] == "grants":
		// The Grants API's line: the call and what it revoked.
		outcome = "grants " + rec["method"]
		if r := strings.Trim(rec["revoked"], "[]"); r != "" {
			outcome += ", revoked " + strings.ReplaceAll(r, `"`, "")
		}
		cluster = "broker"
	case rec["code"] != codes.OK.String():
	case rec["cacheHit"] == "true":
		outcome = "cached " + rec["credentialID"]
	default:
		outcome = "minted " + rec["credentialID"]
	}
	to := cluster
	if sa := rec["serviceAccount"]; sa != "" {
		to += " as " + sa
	}
	latency := rec["latency"]
	if d, err := time.ParseDuration(latency); err == nil {
		latency = round(d).String()
	}
	return fmt.Sprintf("%-16s %-9s %s → %s: %s", rec["code"], latency, rec["user"], to, outcome)
}

// jwtPattern matches a JWS compact serialization whose header and payload
// are JSON objects, as every Kubernetes token is.
var jwtPattern = regexp.MustCompile(`eyJ[A-Za-z0-9_-]+\.eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+`)

// jwtIssuers returns the iss claim, unverified, of every JWT in data ("" when
// it has none).
func jwtIssuers(data []byte) []string {
	var issuers []string
	for _, m := range jwtPattern.FindAll(data, -1) {
		var claims struct {
			Iss string `json:"iss"`
		}
		payload := strings.Split(string(m), ".")[1]
		if raw, err := base64.RawURLEncoding.DecodeString(payload); err == nil {
			_ = json.Unmarshal(raw, &claims)
		}
		issuers = append(issuers, claims.Iss)
	}
	return issuers
}

// lines collects log lines from the broker and the agents.
type lines struct {
	mu sync.Mutex
	l  []string
}

func (b *lines) add(s string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.l = append(b.l, s)
}

func (b *lines) all() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.l)
}
