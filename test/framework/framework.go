package framework

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

const (
	// AssetsEnv names the environment variable that holds the directory with
	// the kube-apiserver and etcd binaries when Options.AssetsDir is empty.
	AssetsEnv = "KUBEBUILDER_ASSETS"

	// HubName is the name of the hub cluster; spokes are named SpokeName(i).
	HubName = "hub"

	// IssuerDomain is the DNS suffix of every cluster's service account
	// issuer: the issuer of cluster "spoke-1" is https://spoke-1.credbroker.test.
	IssuerDomain = "credbroker.test"

	// InventoryModule is the Go module whose config/crd/bases holds the
	// ClusterProfile CRD that the hub installs.
	InventoryModule = "sigs.k8s.io/cluster-inventory-api"

	defaultStartTimeout = 60 * time.Second
	defaultStopTimeout  = 20 * time.Second
	startAttempts       = 3
	adminQPS            = 1000
	adminBurst          = 2000
)

// ErrMissingAssets is wrapped by Start when the kube-apiserver or etcd binary
// cannot be found.
var ErrMissingAssets = errors.New(`kube-apiserver and etcd binaries not found: run "make testbin" and set ` +
	AssetsEnv + ` to the folder it prints (the Makefile does that for "make test")`)

// Options configures Start. The zero value starts a hub and no spokes, with
// binaries from $KUBEBUILDER_ASSETS and logging discarded.
type Options struct {
	// Spokes is the number of spoke clusters, named "spoke-1" … "spoke-N".
	Spokes int
	// AssetsDir holds the kube-apiserver and etcd binaries. Default: $KUBEBUILDER_ASSETS.
	AssetsDir string
	// Log receives progress messages. The zero value discards them.
	Log logr.Logger

	// InventoryCRDDir holds the cluster-inventory-api CRD manifests the hub
	// installs. Default: config/crd/bases of the sigs.k8s.io/cluster-inventory-api
	// module, found with `go list -m` from this repository's module root.
	InventoryCRDDir string
	// StartTimeout bounds how long each etcd and kube-apiserver may take to
	// become healthy. Default: 60s (the machines running the tests are small).
	StartTimeout time.Duration
	// StopTimeout bounds how long each process may take to exit after
	// SIGTERM before it is killed. Default: 20s.
	StopTimeout time.Duration
	// AuditWatches records watch requests in every cluster's audit log
	// too (Cluster.AuditLog), which by default leaves them out, for a test
	// that compares what a client used with what its RBAC grants.
	AuditWatches bool
	// Output, when set, receives the stdout and stderr of every etcd and
	// kube-apiserver, interleaved. Whatever it is, the last few KiB of a
	// cluster's output are kept and put in the error when it fails to start.
	Output io.Writer
}

// Env is a running hub and its spokes. Stop it when done.
type Env struct {
	Hub    *Cluster
	Spokes []*Cluster

	cleanup func() // removes the launchers; nil when there are none
}

// SpokeName returns the name of the i-th spoke, counting from 1.
func SpokeName(i int) string { return "spoke-" + strconv.Itoa(i) }

// IssuerFor returns the service account issuer (and default API audience)
// that Start gives the cluster with this name.
func IssuerFor(name string) string { return "https://" + name + "." + IssuerDomain }

// Start starts the hub and opts.Spokes spokes in parallel, each with its own
// etcd, kube-apiserver, serving CA, service account issuer and signing key,
// and installs the ClusterProfile CRD on the hub. It returns when every API
// server is healthy, its default namespace exists and the CRD is served.
//
// ctx bounds the waits after the processes are up; the process start itself
// is bounded by opts.StartTimeout. On failure Start stops whatever it started
// and returns a nil Env.
func Start(ctx context.Context, opts Options) (*Env, error) {
	if opts.Spokes < 0 {
		return nil, fmt.Errorf("framework: Options.Spokes is %d, want >= 0", opts.Spokes)
	}
	assets, err := resolveAssets(opts.AssetsDir)
	if err != nil {
		return nil, err
	}
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = defaultStartTimeout
	}
	if opts.StopTimeout <= 0 {
		opts.StopTimeout = defaultStopTimeout
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("framework: start: %w", err)
	}

	bin, cleanupBin := launchers(assets, opts.Log)
	began := time.Now()
	names := make([]string, 0, 1+opts.Spokes)
	names = append(names, HubName)
	for i := 1; i <= opts.Spokes; i++ {
		names = append(names, SpokeName(i))
	}

	// Find the CRDs while the processes start; it runs `go list`.
	type crdResult struct {
		dir string
		err error
	}
	crdCh := make(chan crdResult, 1)
	go func() {
		dir, err := inventoryCRDDir(ctx, opts.InventoryCRDDir)
		crdCh <- crdResult{dir, err}
	}()

	clusters := make([]*Cluster, len(names))
	errs := make([]error, len(names))
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Go(func() {
			c, err := startCluster(ctx, name, bin, opts)
			if err == nil && name == HubName {
				crd := <-crdCh
				err = crd.err
				if err == nil {
					began := time.Now()
					if err = c.installInventory(ctx, crd.dir); err == nil {
						opts.Log.Info("cluster inventory installed", "cluster", name, "crds", crd.dir,
							"duration", time.Since(began).Round(time.Millisecond).String())
					}
				}
			}
			clusters[i], errs[i] = c, err
		})
	}
	wg.Wait()

	env := &Env{Hub: clusters[0], Spokes: clusters[1:], cleanup: cleanupBin}
	if err := errors.Join(errs...); err != nil {
		if stopErr := env.Stop(); stopErr != nil {
			err = errors.Join(err, fmt.Errorf("framework: stop after failed start: %w", stopErr))
		}
		return nil, err
	}
	opts.Log.Info("environment started", "clusters", len(names), "duration", time.Since(began).Round(time.Millisecond).String())
	return env, nil
}

// Clusters returns the hub followed by the spokes.
func (e *Env) Clusters() []*Cluster {
	if e == nil {
		return nil
	}
	return append([]*Cluster{e.Hub}, e.Spokes...)
}

// Stop stops every cluster in parallel and removes their temporary files. It
// is safe on a nil or partially started Env and safe to call more than once.
func (e *Env) Stop() error {
	if e == nil {
		return nil
	}
	clusters := e.Clusters()
	errs := make([]error, len(clusters))
	var wg sync.WaitGroup
	for i, c := range clusters {
		wg.Go(func() { errs[i] = c.Stop() })
	}
	wg.Wait()
	if e.cleanup != nil {
		e.cleanup()
	}
	return errors.Join(errs...)
}

// launchers returns the folder to start kube-apiserver and etcd from, and a
// function that removes it. On Linux with setpriv(1) it is a temporary
// folder of scripts that exec the real binaries with a parent-death signal,
// so the servers get SIGTERM when the process that started them dies without
// calling Stop (a test timeout, a panic, os.Exit, SIGKILL). Otherwise it is
// assets itself.
func launchers(assets string, log logr.Logger) (string, func()) {
	if runtime.GOOS != "linux" {
		return assets, func() {}
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		log.V(1).Info("setpriv not found; servers outlive a crashed parent", "error", err.Error())
		return assets, func() {}
	}
	dir, err := os.MkdirTemp("", "credbroker-framework-bin-")
	if err != nil {
		log.V(1).Info("no launcher folder; servers outlive a crashed parent", "error", err.Error())
		return assets, func() {}
	}
	for _, bin := range []string{"kube-apiserver", "etcd"} {
		script := "#!/bin/sh\nexec " + shellQuote(setpriv) + " --pdeathsig TERM -- " +
			shellQuote(filepath.Join(assets, bin)) + ` "$@"` + "\n"
		if err := os.WriteFile(filepath.Join(dir, bin), []byte(script), 0o700); err != nil {
			_ = os.RemoveAll(dir)
			log.V(1).Info("no launcher; servers outlive a crashed parent", "error", err.Error())
			return assets, func() {}
		}
	}
	return dir, func() { _ = os.RemoveAll(dir) }
}

// shellQuote quotes s for a POSIX shell.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// resolveAssets returns the folder with kube-apiserver and etcd, or an error
// wrapping ErrMissingAssets.
func resolveAssets(dir string) (string, error) {
	source := "Options.AssetsDir"
	if dir == "" {
		dir, source = os.Getenv(AssetsEnv), AssetsEnv
	}
	if dir == "" {
		return "", fmt.Errorf("framework: %s is empty: %w", AssetsEnv, ErrMissingAssets)
	}
	for _, bin := range []string{"kube-apiserver", "etcd"} {
		p := filepath.Join(dir, bin)
		fi, err := os.Stat(p)
		if err != nil {
			return "", fmt.Errorf("framework: %s=%q: %w (%w)", source, dir, ErrMissingAssets, err)
		}
		if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
			return "", fmt.Errorf("framework: %s=%q: %s is not an executable file: %w", source, dir, p, ErrMissingAssets)
		}
	}
	return dir, nil
}

// startCluster starts one etcd and kube-apiserver pair, retrying a couple of
// times because envtest picks free ports before the processes bind them.
func startCluster(ctx context.Context, name, bin string, opts Options) (*Cluster, error) {
	log := opts.Log.WithValues("cluster", name)
	var errs []error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		if err := ctx.Err(); err != nil {
			errs = append(errs, err)
			break
		}
		began := time.Now()
		c, err := startClusterOnce(ctx, name, bin, opts)
		if err == nil {
			log.Info("cluster started", "server", c.Server, "attempt", attempt,
				"duration", time.Since(began).Round(time.Millisecond).String())
			return c, nil
		}
		log.Error(err, "cluster failed to start", "attempt", attempt)
		errs = append(errs, fmt.Errorf("attempt %d: %w", attempt, err))
	}
	return nil, fmt.Errorf("framework: start %s: %w", name, errors.Join(errs...))
}

func startClusterOnce(ctx context.Context, name, bin string, opts Options) (*Cluster, error) {
	tail := &tailBuffer{max: 8 << 10}
	out := io.Writer(tail)
	if opts.Output != nil {
		out = io.MultiWriter(tail, opts.Output)
	}
	issuer := IssuerFor(name)
	api := &envtest.APIServer{
		Path:         filepath.Join(bin, "kube-apiserver"),
		StartTimeout: opts.StartTimeout,
		StopTimeout:  opts.StopTimeout,
		Out:          out,
		Err:          out,
	}
	// envtest already writes a fresh serving CA, client CA and service
	// account key pair into each API server's own temporary cert dir, and
	// passes --service-account-key-file, --service-account-signing-key-file,
	// --client-ca-file, --authorization-mode=RBAC and
	// --disable-admission-plugins=ServiceAccount. Its default issuer is the
	// server URL; give each cluster a stable, distinct one instead.
	args := api.Configure()
	args.Set("service-account-issuer", issuer)
	args.Set("api-audiences", issuer)
	args.Set("authorization-mode", "RBAC")
	// Every cluster keeps an audit log, so that tests can follow a request
	// made with a brokered token back to the credential id the broker
	// audited.
	auditDir, err := os.MkdirTemp("", "credbroker-audit-"+name+"-")
	if err != nil {
		return nil, fmt.Errorf("audit dir: %w", err)
	}
	policy := auditPolicy
	if opts.AuditWatches {
		policy = auditPolicyWithWatches
	}
	if err := os.WriteFile(filepath.Join(auditDir, "policy.yaml"), []byte(policy), 0o600); err != nil {
		return nil, errors.Join(fmt.Errorf("audit policy: %w", err), os.RemoveAll(auditDir))
	}
	args.Set("audit-policy-file", filepath.Join(auditDir, "policy.yaml"))
	args.Set("audit-log-path", filepath.Join(auditDir, "audit.log"))
	cp := &envtest.ControlPlane{
		APIServer: api,
		Etcd: &envtest.Etcd{
			Path:         filepath.Join(bin, "etcd"),
			StartTimeout: opts.StartTimeout,
			StopTimeout:  opts.StopTimeout,
			Out:          out,
			Err:          out,
		},
	}
	c := &Cluster{Name: name, Issuer: issuer, AuditLog: filepath.Join(auditDir, "audit.log"), cp: cp, auditDir: auditDir, output: tail}
	if err := cp.Start(); err != nil {
		// ControlPlane.Start stops etcd but not an API server that timed out.
		return nil, errors.Join(
			fmt.Errorf("control plane: %w%s", err, tail.context()),
			c.Stop())
	}
	if err := c.connect(ctx); err != nil {
		return nil, errors.Join(err, c.Stop())
	}
	return c, nil
}

// auditPolicy records who made every request but watches, at the Metadata
// level: user, groups, extra (which carries the credential id), verb,
// object and response code, never a body.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: None
    verbs: ["watch"]
  - level: Metadata
`

// auditPolicyWithWatches is auditPolicy with the watches (Options.AuditWatches).
const auditPolicyWithWatches = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
`

// connect provisions the admin user and clients, and waits for the default
// namespace, as envtest.Environment does.
func (c *Cluster) connect(ctx context.Context) error {
	admin, err := c.cp.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}},
		&rest.Config{QPS: adminQPS, Burst: adminBurst})
	if err != nil {
		return fmt.Errorf("provision admin user: %w", err)
	}
	c.admin = admin
	c.Config = admin.Config()
	c.Server = strings.TrimSuffix(c.Config.Host, "/")
	c.Config.Host = c.Server
	c.CAData = append([]byte(nil), c.Config.CAData...)
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	var last error
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 10*time.Second, true,
		func(ctx context.Context) (bool, error) {
			_, last = c.Client.CoreV1().Namespaces().Get(ctx, corev1.NamespaceDefault, metav1.GetOptions{})
			return last == nil, nil
		})
	if err != nil {
		return fmt.Errorf("wait for the default namespace (last error: %v): %w", last, err)
	}
	return nil
}

// inventoryCRDDir returns dir if set, and otherwise config/crd/bases of the
// cluster-inventory-api module this repository requires.
func inventoryCRDDir(ctx context.Context, dir string) (string, error) {
	if dir == "" {
		cmd := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", InventoryModule)
		cmd.Dir = moduleRoot() // "" (the working directory) when the source is not on disk
		out, err := cmd.Output()
		if err != nil {
			var exitErr *exec.ExitError
			if errors.As(err, &exitErr) {
				err = fmt.Errorf("%w: %s", err, strings.TrimSpace(string(exitErr.Stderr)))
			}
			return "", fmt.Errorf("framework: locate module %s (set Options.InventoryCRDDir to skip this): %w", InventoryModule, err)
		}
		mod := strings.TrimSpace(string(out))
		if mod == "" {
			return "", fmt.Errorf("framework: module %s is not downloaded; run \"go mod download %s\"", InventoryModule, InventoryModule)
		}
		dir = filepath.Join(mod, "config", "crd", "bases")
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return "", fmt.Errorf("framework: ClusterProfile CRD folder %q: not a directory (%v)", dir, err)
	}
	return dir, nil
}

// moduleRoot returns the folder holding the go.mod of this package's module,
// found from this source file, or "" when the source is not on disk (for
// example in a binary built with -trimpath).
func moduleRoot() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok || !filepath.IsAbs(file) {
		return ""
	}
	for dir := filepath.Dir(file); ; {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - t.max; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return len(p), nil
}

// context returns the kept output formatted to follow an error message.
func (t *tailBuffer) context() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := strings.TrimSpace(string(t.buf))
	if s == "" {
		return ""
	}
	return "\nlast output of etcd and kube-apiserver:\n" + s
}

// Kubectl returns the path of the kubectl that hack/testbin.sh builds beside
// kube-apiserver, in $KUBEBUILDER_ASSETS, or an error that says how to get
// it. kubectl on PATH is never used: its version is not the API servers'.
func Kubectl() (string, error) {
	dir := os.Getenv(AssetsEnv)
	if dir == "" {
		return "", fmt.Errorf("framework: kubectl: %w", ErrMissingAssets)
	}
	path := filepath.Join(dir, "kubectl")
	if _, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("framework: kubectl is not in %s=%s (hack/testbin.sh builds it; run \"make testbin\"): %w", AssetsEnv, dir, err)
	}
	return path, nil
}
