package binaries

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/credbroker/credbroker/test/framework"
)

// The suite's environment: one hub and one spoke (test/framework), no
// broker in this process, and bin/broker and bin/spoke-agent as child
// processes, each with a kubeconfig of the ServiceAccount that deploy/hub
// or deploy/spoke creates, bound by the RBAC rendered from them.
var (
	env        *framework.Env
	deployment *framework.Deployment
	spoke      *framework.Cluster

	// brokerBin and agentBin are built from this tree with the Makefile's
	// version ldflags; version is VERSION's.
	brokerBin, agentBin, version string
	broker, agent                *framework.Process
	// exchangeAddr and brokerAgentAddr are the broker's TokenExchange and
	// AgentTunnel ports; brokerMetrics and agentMetrics serve the
	// processes' /metrics, /healthz and /readyz.
	exchangeAddr, brokerAgentAddr, brokerMetrics, agentMetrics string

	// hubObjs and spokeObjs are the renders of deploy/hub and deploy/spoke;
	// brokerAccount and agentAccount the ServiceAccounts in them that the
	// processes run as.
	hubObjs, spokeObjs          []*unstructured.Unstructured
	brokerAccount, agentAccount rbacv1.Subject
)

// The broker's per-consumer burst, as an operator would lower it; its rate
// (--rate-limit) keeps the default.
const rateBurst = 5

// revision is what the binaries are built with as the Makefile's REVISION.
const revision = framework.TestRevision

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	flag.Parse()
	defer framework.WatchStuckTests(os.Stderr)()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "credbroker-binaries-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(dir)

	// Build while the API servers start.
	built := make(chan error, 1)
	go func() { built <- build(ctx, dir) }()
	env, err = framework.Start(ctx, framework.Options{Spokes: 1, AuditWatches: true})
	if err != nil {
		return fail(errors.Join(err, <-built))
	}
	defer env.Stop()
	spoke = env.Spokes[0]
	if err := <-built; err != nil {
		return fail(err)
	}

	if deployment, err = framework.StartDeployment(ctx, env, framework.DeploymentOptions{Dir: dir, NoInProcessBroker: true}); err != nil {
		return fail(err)
	}
	defer deployment.Stop()
	if err := installRBAC(ctx); err != nil {
		return fail(err)
	}
	if err := startBroker(ctx, dir); err != nil {
		return fail(err)
	}
	defer broker.Stop()
	if err := startAgent(ctx, dir); err != nil {
		return fail(err)
	}
	defer agent.Stop()

	code := m.Run()

	// What needs the whole suite: run after every test, whatever the order.
	if err := noTokenInOutput(); err != nil {
		fmt.Fprintln(os.Stderr, "binaries:", err)
		code = 1
	}
	for _, p := range []*framework.Process{broker, agent} {
		_ = p.Signal(syscall.SIGTERM)
		_ = p.Wait()
	}
	if wholeSuite() {
		report, err := usedVersusGranted()
		fmt.Fprint(os.Stderr, report)
		if err != nil {
			fmt.Fprintln(os.Stderr, "binaries:", err)
			code = 1
		}
	}
	if code != 0 || os.Getenv("BINARIES_LOGS") != "" {
		fmt.Fprintf(os.Stderr, "--- broker output:\n%s\n--- agent output:\n%s\n", broker.Output(), agent.Output())
	}
	return code
}

// wholeSuite reports whether every test of the package ran (no -run or
// -skip), which the RBAC usage check needs.
func wholeSuite() bool {
	for _, name := range []string{"test.run", "test.skip"} {
		if f := flag.Lookup(name); f != nil && f.Value.String() != "" {
			return false
		}
	}
	return true
}

// build builds the broker and the agent into dir with the Makefile's
// version ldflags.
func build(ctx context.Context, dir string) error {
	var err error
	if version, err = framework.Version(); err != nil {
		return err
	}
	brokerBin, agentBin = filepath.Join(dir, "broker"), filepath.Join(dir, "spoke-agent")
	return framework.Build(ctx, dir, "broker", "spoke-agent")
}

// installed are the kinds of deploy/ that the suite applies for real:
// identities, their RBAC and the spoke's admission policies, which the
// agent must live with. Workloads need a kubelet, which the test clusters
// do not have; the processes stand in for them.
var installed = map[string]bool{
	"Namespace": true, "ServiceAccount": true,
	"ClusterRole": true, "ClusterRoleBinding": true, "Role": true, "RoleBinding": true,
}

// installRBAC renders deploy/hub and deploy/spoke, applies what installed
// lists (and the spoke's admission policies), finds the ServiceAccounts
// the processes run as, and waits until the RBAC authorizer allows them
// the first rule of each of their roles.
func installRBAC(ctx context.Context) error {
	deploy, err := framework.DeployDir()
	if err != nil {
		return err
	}
	for _, c := range []struct {
		cluster   *framework.Cluster
		dir       string
		objs      *[]*unstructured.Unstructured
		account   *rbacv1.Subject
		admission bool
	}{
		{env.Hub, "hub", &hubObjs, &brokerAccount, false},
		{spoke, "spoke", &spokeObjs, &agentAccount, true},
	} {
		all, err := framework.Kustomize(ctx, filepath.Join(deploy, c.dir))
		if err != nil {
			return err
		}
		var apply []*unstructured.Unstructured
		for _, o := range all {
			k := o.GetKind()
			if installed[k] || (c.admission && strings.HasPrefix(k, "ValidatingAdmissionPolicy")) {
				apply = append(apply, o)
			}
		}
		*c.objs = apply
		if err := c.cluster.Apply(ctx, apply); err != nil {
			return err
		}
		var accounts []string
		for _, o := range apply {
			if o.GetKind() == "ServiceAccount" {
				accounts = append(accounts, o.GetNamespace()+"/"+o.GetName())
				*c.account = framework.ServiceAccountSubject(o.GetNamespace(), o.GetName())
			}
		}
		if len(accounts) != 1 {
			return fmt.Errorf("deploy/%s renders ServiceAccounts %v; the suite expects one", c.dir, accounts)
		}
		rules, err := grantedRules(apply, *c.account)
		if err != nil {
			return err
		}
		if len(rules) == 0 {
			return fmt.Errorf("deploy/%s grants %s nothing", c.dir, accounts[0])
		}
		if err := waitAllowed(ctx, c.cluster, *c.account, rules, resourceNamesOf(apply)); err != nil {
			return err
		}
	}
	return nil
}

// waitAllowed waits until the cluster's authorizer allows subject every
// resource permission of rules, in subject's namespace (which a Role of
// it grants) and on the one object that names narrow it to, if any.
func waitAllowed(ctx context.Context, c *framework.Cluster, subject rbacv1.Subject, rules []permission, names map[permission]string) error {
	for _, p := range rules {
		if p.nonResource() {
			continue
		}
		resource, sub, _ := strings.Cut(p.resource, "/")
		attrs := authorizationv1.ResourceAttributes{Verb: p.verb, Group: p.group, Resource: resource, Subresource: sub,
			Namespace: subject.Namespace, Name: names[p]}
		err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
			return c.Allowed(ctx, subject, attrs)
		})
		if err != nil {
			return fmt.Errorf("%s: %s is not allowed %v: %w", c.Name, subject.Name, p, err)
		}
	}
	return nil
}

// resourceNamesOf returns, for the permissions of objs' Roles and
// ClusterRoles that resourceNames narrow, one of the names.
func resourceNamesOf(objs []*unstructured.Unstructured) map[permission]string {
	out := map[permission]string{}
	for _, o := range objs {
		if o.GetKind() != "ClusterRole" && o.GetKind() != "Role" {
			continue
		}
		var r rbacv1.ClusterRole
		if runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &r) != nil {
			continue
		}
		for _, rule := range r.Rules {
			if len(rule.ResourceNames) > 0 {
				for _, p := range flatten([]rbacv1.PolicyRule{rule}) {
					out[p] = rule.ResourceNames[0]
				}
			}
		}
	}
	return out
}

// grantedRules returns the permissions that objs' ClusterRoleBindings and
// RoleBindings give subject, through the ClusterRoles and Roles in objs.
func grantedRules(objs []*unstructured.Unstructured, subject rbacv1.Subject) ([]permission, error) {
	roles := map[string][]rbacv1.PolicyRule{}
	for _, o := range objs {
		if o.GetKind() == "ClusterRole" || o.GetKind() == "Role" {
			var r rbacv1.ClusterRole // a Role has the same rules
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &r); err != nil {
				return nil, err
			}
			roles[o.GetKind()+"/"+o.GetNamespace()+"/"+o.GetName()] = r.Rules
		}
	}
	var out []permission
	for _, o := range objs {
		if o.GetKind() != "ClusterRoleBinding" && o.GetKind() != "RoleBinding" {
			continue
		}
		var b rbacv1.RoleBinding // a ClusterRoleBinding has the same fields
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &b); err != nil {
			return nil, err
		}
		if !slices.ContainsFunc(b.Subjects, func(s rbacv1.Subject) bool {
			return s.Kind == subject.Kind && s.Name == subject.Name && s.Namespace == subject.Namespace
		}) {
			continue
		}
		ns := ""
		if b.RoleRef.Kind == "Role" {
			ns = o.GetNamespace()
		}
		rules, ok := roles[b.RoleRef.Kind+"/"+ns+"/"+b.RoleRef.Name]
		if !ok {
			return nil, fmt.Errorf("%s %s binds %s %s, which deploy/ does not render", o.GetKind(), o.GetName(), b.RoleRef.Kind, b.RoleRef.Name)
		}
		for _, p := range flatten(rules) {
			if !slices.Contains(out, p) {
				out = append(out, p)
			}
		}
	}
	return out, nil
}

// startBroker runs the suite's bin/broker, as deploy/hub's ServiceAccount,
// and waits until /readyz answers 200.
func startBroker(ctx context.Context, dir string) error {
	p, err := launchBroker(ctx, dir, fmt.Sprintf("--rate-burst=%d", rateBurst), "--shutdown-grace=2s", "--shutdown-delay=0s")
	if err != nil {
		return err
	}
	broker, exchangeAddr, brokerAgentAddr, brokerMetrics = p.Process, p.exchange, p.agent, p.metrics
	return nil
}

// startAgent runs the suite's bin/spoke-agent against the broker, as
// deploy/spoke's ServiceAccount, and waits until /readyz answers 200: its
// stream is admitted.
func startAgent(ctx context.Context, dir string) error {
	var err error
	agent, agentMetrics, err = launchAgent(ctx, dir, brokerAgentAddr, "--shutdown-grace=2s")
	return err
}

// brokerProcess is a bin/broker process and its addresses.
type brokerProcess struct {
	*framework.Process
	exchange, agent, metrics string
}

// processes are every process the suite started, whose output
// noTokenInOutput reads.
var processes struct {
	sync.Mutex
	all []namedProcess
}

type namedProcess struct {
	name string
	*framework.Process
}

func started(name string, p *framework.Process) {
	processes.Lock()
	defer processes.Unlock()
	processes.all = append(processes.all, namedProcess{name, p})
}

// launchAttempts is how many times launchBroker and launchAgent pick free
// ports: another process may take one before theirs binds it.
const launchAttempts = 3

// launchBroker runs bin/broker with args, as deploy/hub's ServiceAccount
// with a kubeconfig written into dir, on free ports, and waits until
// /readyz answers 200.
func launchBroker(ctx context.Context, dir string, args ...string) (brokerProcess, error) {
	kubeconfig, err := env.Hub.WriteServiceAccountKubeconfig(ctx, dir, brokerAccount.Namespace, brokerAccount.Name, time.Hour)
	if err != nil {
		return brokerProcess{}, err
	}
	var errs []error
	for range launchAttempts {
		var p brokerProcess
		for _, addr := range []*string{&p.exchange, &p.agent, &p.metrics} {
			if *addr, err = framework.FreeAddr(); err != nil {
				return p, err
			}
		}
		p.Process, err = deployment.StartBrokerProcess(framework.BrokerProcessOptions{
			Bin: brokerBin, Kubeconfig: kubeconfig,
			ExchangeAddress: p.exchange, AgentAddress: p.agent, MetricsAddress: p.metrics,
			// deploy/hub's, which its RBAC grants.
			TriggerLeaseName: "credbroker-triggers",
			Args:             args,
		})
		if errors.Is(err, framework.ErrAddrInUse) {
			errs = append(errs, err)
			continue
		}
		if err != nil {
			return p, err
		}
		started("broker", p.Process)
		return p, waitReady(ctx, "broker", p.Process, p.metrics)
	}
	return brokerProcess{}, errors.Join(errs...)
}

// launchAgent runs bin/spoke-agent with args against the broker agent port
// brokerAddr, as deploy/spoke's ServiceAccount with a kubeconfig written
// into dir, and waits until /readyz answers 200. It returns the process
// and its metrics address.
func launchAgent(ctx context.Context, dir, brokerAddr string, args ...string) (*framework.Process, string, error) {
	kubeconfig, err := spoke.WriteServiceAccountKubeconfig(ctx, dir, agentAccount.Namespace, agentAccount.Name, time.Hour)
	if err != nil {
		return nil, "", err
	}
	for attempt := 1; ; attempt++ {
		metrics, err := framework.FreeAddr()
		if err != nil {
			return nil, "", err
		}
		p, err := deployment.StartAgentProcess(ctx, spoke, framework.AgentProcessOptions{
			Bin: agentBin, Kubeconfig: kubeconfig, BrokerAddresses: []string{brokerAddr},
			Args: append([]string{"--metrics-address=" + metrics}, args...),
		})
		if err != nil {
			return nil, "", err
		}
		started("spoke-agent", p)
		err = waitReady(ctx, "spoke-agent", p, metrics)
		if err != nil && p.AddrInUse() && attempt < launchAttempts {
			continue // its metrics port was taken: another
		}
		return p, metrics, err
	}
}

// waitReady waits up to 60s for http://addr/readyz to answer 200, or for
// the process to exit.
func waitReady(ctx context.Context, name string, p *framework.Process, addr string) error {
	exited := make(chan error, 1)
	go func() { exited <- p.Wait() }()
	var last string
	err := wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		select {
		case err := <-exited:
			return false, fmt.Errorf("%s exited: %v", name, err)
		default:
		}
		code, body, err := get(ctx, "http://"+addr+"/readyz")
		if err != nil {
			last = err.Error()
			return false, nil
		}
		last = fmt.Sprintf("%d %s", code, body)
		return code == http.StatusOK, nil
	})
	if err != nil {
		return fmt.Errorf("%s is not ready (last /readyz: %s): %w\n%s", name, last, err, p.Output())
	}
	return nil
}

func fail(err error) int {
	fmt.Fprintln(os.Stderr, "binaries: setup failed:", err)
	return 1
}

// minted collects every token the suite saw: spoke tokens the broker
// returned and the consumers' hub tokens, none of which may reach the
// hub's storage or a process's output.
var minted struct {
	sync.Mutex
	spoke, hub []string
}

// noTokenInOutput checks, after the whole suite, that no token it saw is
// in the output (operational log and audit lines) of a broker or an agent
// it started.
func noTokenInOutput() error {
	minted.Lock()
	defer minted.Unlock()
	processes.Lock()
	defer processes.Unlock()
	var errs []error
	for _, p := range processes.all {
		out := p.Output()
		for _, tok := range slices.Concat(minted.spoke, minted.hub) {
			if strings.Contains(out, tok) {
				errs = append(errs, fmt.Errorf("a token reached the output of %s", p.name))
			}
		}
	}
	return errors.Join(errs...)
}

// hubSecretsAndConfigMaps returns every value stored in a Secret or
// ConfigMap of the hub.
func hubSecretsAndConfigMaps(ctx context.Context) ([]string, error) {
	secrets, err := env.Hub.Client.CoreV1().Secrets("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	configMaps, err := env.Hub.Client.CoreV1().ConfigMaps("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var out []string
	for _, s := range secrets.Items {
		for _, v := range s.Data {
			out = append(out, string(v))
		}
		for _, v := range s.StringData {
			out = append(out, v)
		}
	}
	for _, cm := range configMaps.Items {
		for _, v := range cm.Data {
			out = append(out, v)
		}
		for _, v := range cm.BinaryData {
			out = append(out, string(v))
		}
	}
	return out, nil
}
