package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
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

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	authenticationv1 "k8s.io/api/authentication/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"

	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/pkg/spoke"
	"github.com/credbroker/credbroker/pkg/token"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// Who the story is about.
const (
	// hubAudience is the audience of the consumer's hub token: the broker's
	// default Audience, which a projected volume would ask for.
	hubAudience = "credbroker"

	consumerNamespace = "argocd"
	consumerName      = "application-controller"
	// outsiderName is a second hub ServiceAccount in consumerNamespace, with
	// no RBAC for clusterprofiles/token.
	outsiderName = "notifications-controller"

	spokeNamespace = "team-a"
	spokeAccount   = "deployer"

	indent = "      "
)

// spokeName is the name of the only spoke.
var spokeName = framework.SpokeName(1)

// errUsage is returned by parseFlags once the flag package has reported the
// problem.
var errUsage = errors.New("usage")

type config struct {
	// plugin and cli are the absolute paths of the credbroker-plugin and
	// credbroker binaries.
	plugin, cli string
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
	fs.BoolVar(&cfg.keep, "keep", false, "after the story, keep the hub, the spoke, the broker and the agent running until Ctrl-C, and print kubeconfigs to look around")
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
	if cfg.plugin, err = executable("--plugin", cfg.plugin, "bin/credbroker-plugin"); err != nil {
		return cfg, err
	}
	if cfg.cli, err = executable("--cli", cfg.cli, "bin/credbroker"); err != nil {
		return cfg, err
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

	env        *framework.Env
	hub, spoke *framework.Cluster
	deployment *framework.Deployment
	logs       lines // the broker's and the agent's logs
	audit      lines // the broker's audit lines, one JSON object each

	hubToken, hubTokenFile string
	providerFile           string
	conn                   *grpc.ClientConn // to the broker's TokenExchange
	exchange               pb.TokenExchangeClient
}

// run tells the story, then cleans up whatever it started, however it ends:
// when ctx ends, it says so at once and cleans up.
func run(ctx context.Context, cfg config) (err error) {
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
		{"starting hub and spoke API servers (etcd + kube-apiserver each)", d.startClusters},
		{"starting the broker against the hub", d.startBroker},
		{fmt.Sprintf("starting the agent on %s; it dials out to the broker", spokeName), d.startAgent},
		{fmt.Sprintf("on the hub: the consumer %s/%s, allowed to ask for %s", consumerNamespace, consumerName, spokeName), d.createConsumer},
		{fmt.Sprintf("on %s: %s/%s, which opts in to that consumer", spokeName, spokeNamespace, spokeAccount), d.createSpokeAccount},
		{fmt.Sprintf("minting the consumer's hub token for audience %q, as a projected volume would", hubAudience), d.mintHubToken},
		{fmt.Sprintf("the consumer uses %s through credbroker-plugin", spokeName), d.useSpoke},
		{"a hub ServiceAccount without RBAC asks too", d.showRefusal},
		{fmt.Sprintf("the admin of %s traces a request to the consumer, and the consumer's token is revoked", spokeName), d.traceAndRevoke},
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
	fmt.Fprintf(d.out, "the story took %s: the consumer used %s with a token minted there, and the hub never held it.\n",
		round(time.Since(began)), d.spoke.Name)

	if d.keep {
		return d.keepRunning(ctx)
	}
	return nil
}

// 1. Two clusters, each with its own etcd, CA and service account issuer.
func (d *demo) startClusters(ctx context.Context) error {
	env, err := framework.Start(ctx, framework.Options{Spokes: 1})
	if err != nil {
		return err // names `make testbin` when the binaries are missing
	}
	d.env, d.hub, d.spoke = env, env.Hub, env.Spokes[0]
	for _, c := range env.Clusters() {
		d.say("%-8s %s  service account issuer %s", c.Name, c.Server, c.Issuer)
	}
	return nil
}

// 2. The broker, and the ClusterProfile that tells consumers how to reach
// the spoke.
func (d *demo) startBroker(ctx context.Context) error {
	pki := filepath.Join(d.dir, "pki")
	if err := os.Mkdir(pki, 0o700); err != nil {
		return err
	}
	dep, err := framework.StartDeployment(ctx, d.env, framework.DeploymentOptions{
		Dir:   pki,
		Log:   d.logs.logger(),
		Audit: d.audit.jsonLogger(),
	})
	if err != nil {
		return err
	}
	d.deployment = dep
	d.say("TokenExchange, for consumers (TLS)     %s", dep.Broker.ExchangeAddr())
	d.say("AgentTunnel, for agents (SPIFFE mTLS)  %s", dep.Broker.AgentAddr())
	d.say("trust domain                           %s", framework.TrustDomain)

	cp, err := dep.ClusterProfile(ctx, d.spoke)
	if err != nil {
		return err
	}
	for _, p := range cp.Status.AccessProviders {
		d.say("ClusterProfile %s/%s on the hub, access provider %q:", cp.Namespace, cp.Name, p.Name)
		d.say("  server %s, CA %d bytes of PEM", p.Cluster.Server, len(p.Cluster.CertificateAuthorityData))
		for _, ext := range p.Cluster.Extensions {
			d.say("  extension %s: %s", ext.Name, ext.Extension.Raw)
		}
	}
	d.say("  and no credential for it")
	return nil
}

// 3. The agent: the only thing on the spoke that can mint tokens for others.
func (d *demo) startAgent(ctx context.Context) error {
	id := framework.AgentID(d.spoke.Name)
	d.say("identity on %s: ServiceAccount %s/%s, allowed to", d.spoke.Name, framework.AgentNamespace, framework.AgentServiceAccount)
	for _, rule := range framework.AgentRules() {
		d.say("  %s", describeRule(rule))
	}
	d.say("identity towards the broker: SVID %s", id)
	if _, err := d.deployment.StartAgent(ctx, d.spoke, id); err != nil {
		return err
	}
	d.say("the broker admitted it: %d agent stream serves ClusterProfile %s/%s",
		d.deployment.Broker.Connected(framework.FleetNamespace, d.spoke.Name), framework.FleetNamespace, d.spoke.Name)
	return nil
}

// 4. The hub decides who may ask for a spoke: RBAC on clusterprofiles/token.
func (d *demo) createConsumer(ctx context.Context) error {
	if _, err := d.hub.CreateServiceAccount(ctx, consumerNamespace, consumerName, nil); err != nil {
		return err
	}
	if err := d.hub.GrantClusterProfileToken(ctx, framework.FleetNamespace, d.spoke.Name, consumerNamespace, consumerName); err != nil {
		return err
	}
	d.say("ServiceAccount %s/%s, user %s", consumerNamespace, consumerName, consumerUser())
	d.say("Role and RoleBinding in namespace %s: %s",
		framework.FleetNamespace, describeRule(framework.ClusterProfileTokenRule(d.spoke.Name)))
	return nil
}

// 5. The spoke decides what the consumer gets: a ServiceAccount that opts
// in, with the spoke's own RBAC.
func (d *demo) createSpokeAccount(ctx context.Context) error {
	// The consumer may name the spoke API server's own audience (its
	// issuer), which the timings below ask for; without the audiences
	// annotation it could get only a token for the default audiences,
	// requested by naming none.
	annotations := map[string]string{
		spoke.AllowedSubjectsAnnotation:  consumerUser(),
		spoke.AllowedAudiencesAnnotation: d.spoke.Issuer,
	}
	sa, err := d.spoke.CreateServiceAccount(ctx, spokeNamespace, spokeAccount, annotations)
	if err != nil {
		return err
	}
	// The agent reads the annotation from its informer; wait until it has.
	if err := d.deployment.WaitForServiceAccount(ctx, d.spoke, sa); err != nil {
		return err
	}
	rules := []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"list"}}}
	if err := d.spoke.Grant(ctx, "", framework.ServiceAccountSubject(spokeNamespace, spokeAccount), rules); err != nil {
		return err
	}
	d.say("ServiceAccount %s/%s", spokeNamespace, spokeAccount)
	d.say("  annotation %s=%s", spoke.AllowedSubjectsAnnotation, consumerUser())
	d.say("  annotation %s=%s", spoke.AllowedAudiencesAnnotation, d.spoke.Issuer)
	for _, rule := range rules {
		d.say("  ClusterRole and ClusterRoleBinding: %s", describeRule(rule))
	}
	return nil
}

// 6. What the kubelet would put in the consumer pod: a hub token bound to
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

	review, err := d.spoke.ReviewToken(ctx, tok, nil)
	if err != nil {
		return err
	}
	if review.Authenticated {
		return fmt.Errorf("%s accepted the hub token", d.spoke.Name)
	}
	d.say("%s rejects it (TokenReview: authenticated=%t): it is good for the broker only", d.spoke.Name, review.Authenticated)
	return nil
}

// 7. The consumer's side: a provider file, the ClusterProfile, and client-go.
func (d *demo) useSpoke(ctx context.Context) error {
	providers, err := d.writeProviderFile()
	if err != nil {
		return err
	}
	cp, err := d.deployment.ClusterProfile(ctx, d.spoke)
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
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}

	began := time.Now()
	list, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	took := time.Since(began)
	names := make([]string, 0, len(list.Items))
	for _, ns := range list.Items {
		names = append(names, ns.Name)
	}
	d.say("namespaces on %s: %s", d.spoke.Name, strings.Join(names, ", "))
	d.say("  (%s for the first request, running the plugin and the exchange included)", round(took))

	self, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	want, _ := framework.ServiceAccountUser(spokeNamespace, spokeAccount)
	if got := self.Status.UserInfo.Username; got != want {
		return fmt.Errorf("the spoke authenticated the consumer as %q, want %q", got, want)
	}
	d.say("authenticated on the spoke as %s", self.Status.UserInfo.Username)

	return d.timeExchanges(ctx)
}

// writeProviderFile writes the cluster-inventory-api provider file that a
// consumer ships: which exec plugin serves the access provider "credbroker".
func (d *demo) writeProviderFile() (*access.Config, error) {
	args := []string{
		"--broker-address", d.deployment.Broker.ExchangeAddr(),
		"--ca-file", d.deployment.CAFile,
		"--token-file", d.hubTokenFile,
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
	d.say("  %s %s", d.plugin, strings.Join(args, " "))
	return access.NewFromFile(d.providerFile)
}

// timeExchanges times, once each, an exchange that the broker mints through
// the agent, the same exchange again (from the broker's cache), and a direct
// TokenRequest on the spoke. It is a display, not a benchmark: see `make
// bench` for that.
func (d *demo) timeExchanges(ctx context.Context) error {
	if err := d.dialBroker(ctx); err != nil {
		return err
	}
	// The plugin asked for the spoke's default audiences; naming them makes a
	// new cache key, so the first call below is minted on the spoke.
	audiences := []string{d.spoke.Issuer}
	req := &pb.ExchangeRequest{Cluster: d.clusterRef(), Audiences: audiences}
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
		return d.spoke.Token(ctx, spokeNamespace, spokeAccount, audiences, time.Hour)
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
		round(coldTook), d.spoke.Name, sa.GetNamespace(), sa.GetName(), cold.GetCredentialId())
	d.say("  %-9s exchange, cached: %s, from the broker's cache", round(cachedTook), same)
	d.say("  %-9s TokenRequest directly on %s, as its admin", round(directTook), d.spoke.Name)
	return nil
}

// 8. A valid hub token is not enough: the hub's RBAC must allow the spoke.
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
	_, err = d.exchange.Exchange(withBearer(ctx, tok), &pb.ExchangeRequest{Cluster: d.clusterRef()})
	st := status.Convert(err)
	if st.Code() != codes.PermissionDenied {
		return fmt.Errorf("exchange without RBAC: got %s (%q), want PermissionDenied", st.Code(), st.Message())
	}
	d.say("refused: %s", st.Code())
	d.say("message: %s", st.Message())
	return nil
}

// 9. Any request the spoke audited names its hub consumer, and a revoke
// reaches a token already in the consumer's hands.
func (d *demo) traceAndRevoke(ctx context.Context) error {
	resp, err := d.exchange.Exchange(withBearer(ctx, d.hubToken), &pb.ExchangeRequest{Cluster: d.clusterRef()})
	if err != nil {
		return fmt.Errorf("exchange: %w", err)
	}
	tok := resp.GetToken()
	selfReview := func() error {
		client, err := kubernetes.NewForConfig(d.spoke.TokenConfig(tok))
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
		events, err := d.spoke.AuditEvents(func(ev framework.AuditEvent) bool {
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
		return fmt.Errorf("the spoke's audit log has no event with credential id %s", resp.GetCredentialId())
	}
	jti, _ := strings.CutPrefix(audited, "JTI=")
	selector := spoke.GrantJTILabel + "=" + jti
	grants, err := d.spoke.Client.CoreV1().Secrets(metav1.NamespaceAll).List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		return err
	}
	if len(grants.Items) != 1 {
		return fmt.Errorf("kubectl get secrets -A -l %s: %d grants, want 1", selector, len(grants.Items))
	}
	g := grants.Items[0]
	d.say("kubectl get secrets -A -l %s: grant %s/%s, for hub consumer %s through ClusterProfile %s",
		selector, g.Namespace, g.Name, g.Annotations[spoke.GrantHubUserAnnotation], g.Annotations[spoke.GrantClusterProfileAnnotation])

	// The consumer revokes its own token with the people's CLI.
	args := []string{"grants", "revoke", "--broker", d.deployment.Broker.ExchangeAddr(), "--ca-file", d.deployment.CAFile,
		"--token-file", d.hubTokenFile, "--credential-id", audited, "--reason", "demo: the token leaked"}
	d.say("$ credbroker %s", strings.Join(quoted(args), " "))
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

// 10. The hub stores no spoke token, and the broker logs none.
func (d *demo) showHubState(ctx context.Context) error {
	secrets, err := d.hub.Client.CoreV1().Secrets(metav1.NamespaceAll).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	holding := 0
	for _, s := range secrets.Items {
		for _, v := range s.Data {
			if slices.Contains(jwtIssuers(v), d.spoke.Issuer) {
				holding++
				break
			}
		}
	}
	d.say("Secrets on the hub, all namespaces: %d; holding a %s token: %d", len(secrets.Items), d.spoke.Name, holding)
	if holding > 0 {
		return fmt.Errorf("%d hub Secrets hold a %s token", holding, d.spoke.Name)
	}

	audit := d.audit.all()
	d.say("the broker's audit log, one line per call:")
	for _, line := range audit {
		d.say("  %s", describeAudit(line))
	}
	logs := append(d.logs.all(), audit...)
	tokens := len(jwtIssuers([]byte(strings.Join(logs, "\n"))))
	d.say("broker and agent logs: %d lines, %d tokens in them", len(logs), tokens)
	if tokens > 0 {
		return fmt.Errorf("the broker's or the agent's logs hold %d tokens", tokens)
	}
	return nil
}

// keepRunning prints admin kubeconfigs and waits for Ctrl-C.
func (d *demo) keepRunning(ctx context.Context) error {
	hubConfig, err := d.hub.WriteKubeconfig(d.dir)
	if err != nil {
		return err
	}
	spokeConfig, err := d.spoke.WriteKubeconfig(d.dir)
	if err != nil {
		return err
	}
	fmt.Fprintln(d.out, "--keep: everything stays up until Ctrl-C. Admin kubeconfigs:")
	d.say("%-8s %s", d.hub.Name, hubConfig)
	d.say("%-8s %s", d.spoke.Name, spokeConfig)
	d.say("for example:")
	d.say("  kubectl --kubeconfig %s get clusterprofile -n %s %s -o yaml", hubConfig, framework.FleetNamespace, d.spoke.Name)
	d.say("  kubectl --kubeconfig %s get serviceaccount -n %s %s -o yaml", spokeConfig, spokeNamespace, spokeAccount)
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
		fmt.Fprintln(d.out, "stopping the broker and the agent, then the API servers…")
		if d.conn != nil {
			errs = append(errs, d.conn.Close())
		}
		if d.deployment != nil {
			errs = append(errs, d.deployment.Stop())
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
	pem, err := os.ReadFile(d.deployment.CAFile)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return fmt.Errorf("no certificate in %s", d.deployment.CAFile)
	}
	addr := d.deployment.Broker.ExchangeAddr()
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

func (d *demo) clusterRef() *pb.ObjectReference {
	return &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: d.spoke.Name}
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

// describeAudit shortens one of the broker's JSON audit lines.
func describeAudit(line string) string {
	var rec struct {
		Msg, Code, User, Cluster, ServiceAccount, CredentialID, Latency string
		Method                                                          string
		Revoked                                                         []string
		CacheHit                                                        bool
	}
	if err := json.Unmarshal([]byte(line), &rec); err != nil {
		return line
	}
	outcome := "refused"
	switch {
	case rec.Msg == "grants":
		// The Grants API's line: the call and what it revoked.
		outcome = "grants " + rec.Method
		if len(rec.Revoked) > 0 {
			outcome += ", revoked " + strings.Join(rec.Revoked, ", ")
		}
		rec.Cluster = "broker"
	case rec.Code != codes.OK.String():
	case rec.CacheHit:
		outcome = "cached " + rec.CredentialID
	default:
		outcome = "minted " + rec.CredentialID
	}
	to := rec.Cluster
	if rec.ServiceAccount != "" {
		to += " as " + rec.ServiceAccount
	}
	latency := rec.Latency
	if d, err := time.ParseDuration(latency); err == nil {
		latency = round(d).String()
	}
	return fmt.Sprintf("%-16s %-9s %s → %s: %s", rec.Code, latency, rec.User, to, outcome)
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

// lines collects log lines from the broker and the agent.
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

func (b *lines) logger() logr.Logger {
	return funcr.New(func(prefix, args string) { b.add(prefix + " " + args) }, funcr.Options{})
}

func (b *lines) jsonLogger() logr.Logger {
	return funcr.NewJSON(func(obj string) { b.add(obj) }, funcr.Options{})
}
