package framework

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
)

const (
	// SPIREEnv names the environment variable that holds the directory with
	// the spire-server and spire-agent binaries when SPIREOptions.BinDir is
	// empty. `make test` sets it to what hack/spire.sh prints.
	SPIREEnv = "CREDBROKER_SPIRE"

	// DefaultX509SVIDTTL is the lifetime of the workload SVIDs that SPIRE
	// issues when SPIREOptions.X509SVIDTTL is zero. A SPIRE agent renews an
	// SVID once half of its lifetime (which SPIRE backdates by 10s) is gone,
	// so with 30s a workload gets a new SVID about every 11s.
	DefaultX509SVIDTTL = 30 * time.Second

	spireOutputKeep = 64 << 10
)

// ErrMissingSPIRE is wrapped by StartSPIRE when the spire-server or
// spire-agent binary cannot be found.
var ErrMissingSPIRE = errors.New(`spire-server and spire-agent binaries not found: run "make spire" and set ` +
	SPIREEnv + ` to the folder it prints (the Makefile does that for "make test")`)

// SPIREOptions configure StartSPIRE. The zero value is usable.
type SPIREOptions struct {
	// BinDir holds spire-server and spire-agent. Default: $CREDBROKER_SPIRE.
	BinDir string
	// X509SVIDTTL is the server's default_x509_svid_ttl. Default
	// DefaultX509SVIDTTL.
	X509SVIDTTL time.Duration
	// StartTimeout bounds how long the server and each agent may take to
	// become healthy. Default 60s.
	StartTimeout time.Duration
	// StopTimeout bounds how long each process may take to exit after
	// SIGTERM before it is killed. Default 20s.
	StopTimeout time.Duration
	// Log receives progress messages. The zero value discards them.
	Log logr.Logger
	// Output, when set, receives the logs of the server and the agents, each
	// line prefixed with the process's name. Whatever it is, the last 64 KiB
	// are kept for SPIRE.Output and for the errors of a failed start.
	Output io.Writer
}

// SPIRE is a running SPIRE server for TrustDomain on loopback, and the SPIRE
// agents started with StartAgent. Stop it when done.
//
// Every in-process component of a test (a broker, an agent) shares the test
// process and so its uid, pid and binary: no unix selector tells them apart.
// So each gets a SPIRE agent of its own, as each would get the agent of its
// own node in a real fleet, and its registration entry is parented to that
// agent: an agent serves only the entries whose parent it is, so each
// Workload API socket serves exactly the SVID registered on it.
type SPIRE struct {
	// TrustDomain is TrustDomain, the trust domain the server signs for.
	TrustDomain spiffeid.TrustDomain
	// ServerAddress is the server's host:port on loopback.
	ServerAddress string
	// X509SVIDTTL is the server's default_x509_svid_ttl.
	X509SVIDTTL time.Duration
	// BundleFile is the PEM of the server's CA, as the agents bootstrap from.
	BundleFile string

	bin        string
	dir        string // removed by Stop; short, for the unix socket paths
	adminSock  string
	opts       SPIREOptions
	tail       *tailBuffer
	server     *spireProcess
	mu         sync.Mutex
	agents     []*SPIREAgent
	stopOnce   sync.Once
	stopErr    error
	agentCount int
}

// SPIREAgent is a SPIRE agent attested to the server with a join token; its
// Workload API serves the workloads registered with RegisterWorkload.
type SPIREAgent struct {
	// Name names the agent in logs and files.
	Name string
	// ID is the agent's own SPIFFE ID, the parent of its entries:
	// spiffe://<trust domain>/spire/agent/join_token/<token>.
	ID spiffeid.ID
	// SocketPath is the path of the agent's Workload API socket.
	SocketPath string

	s    *SPIRE
	proc *spireProcess
}

// Endpoint is the Workload API address of the agent in the form that
// go-spiffe's workloadapi.WithAddr and --spiffe-endpoint-socket take:
// unix:///path/to/socket.
func (a *SPIREAgent) Endpoint() string { return "unix://" + a.SocketPath }

// StartSPIRE starts a SPIRE server for TrustDomain with a sqlite datastore in
// a temporary folder, listening on a free loopback port, and returns once it
// is healthy. On failure it stops whatever it started and returns a nil
// SPIRE.
func StartSPIRE(ctx context.Context, opts SPIREOptions) (*SPIRE, error) {
	bin, err := resolveSPIRE(opts.BinDir)
	if err != nil {
		return nil, err
	}
	if opts.X509SVIDTTL <= 0 {
		opts.X509SVIDTTL = DefaultX509SVIDTTL
	}
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = defaultStartTimeout
	}
	if opts.StopTimeout <= 0 {
		opts.StopTimeout = defaultStopTimeout
	}
	// Unix socket paths are limited to about 100 bytes, so everything lives
	// in a short temporary folder rather than a test's.
	dir, err := os.MkdirTemp("", "spire-")
	if err != nil {
		return nil, fmt.Errorf("framework: spire: %w", err)
	}
	s := &SPIRE{
		TrustDomain: spiffeid.RequireTrustDomainFromString(TrustDomain),
		X509SVIDTTL: opts.X509SVIDTTL,
		BundleFile:  filepath.Join(dir, "bundle.pem"),
		bin:         bin,
		dir:         dir,
		adminSock:   filepath.Join(dir, "server.sock"),
		opts:        opts,
		tail:        &tailBuffer{max: spireOutputKeep},
	}
	began := time.Now()
	var errs []error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		// The port is picked free before the server binds it, so another
		// process may take it in between: then try again.
		err := s.startServer(ctx, attempt)
		if err == nil {
			break
		}
		errs = append(errs, fmt.Errorf("attempt %d: %w", attempt, err))
		if ctx.Err() != nil || attempt == startAttempts {
			return nil, errors.Join(fmt.Errorf("framework: start spire-server: %w%s",
				errors.Join(errs...), s.outputContext()), s.Stop())
		}
	}
	bundle, err := s.cli(ctx, "bundle", "show")
	if err == nil {
		err = os.WriteFile(s.BundleFile, bundle, 0o600)
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("framework: spire-server bundle: %w", err), s.Stop())
	}
	opts.Log.Info("spire-server started", "address", s.ServerAddress, "trustDomain", TrustDomain,
		"x509SVIDTTL", s.X509SVIDTTL.String(), "duration", time.Since(began).Round(time.Millisecond).String())
	return s, nil
}

// serverConf is the whole spire-server configuration: only what differs
// from SPIRE's defaults, or what a test must know.
const serverConf = `server {
    # Loopback only, on a port the harness picked free.
    bind_address = "127.0.0.1"
    bind_port = "%d"
    # The admin API, which the spire-server CLI uses to create join tokens
    # and entries and to show the bundle.
    socket_path = %q
    trust_domain = %q
    data_dir = %q
    log_level = "INFO"
    # Short, so that a test sees workload SVIDs rotate.
    default_x509_svid_ttl = %q
    # The CA outlives any test (it is SPIRE's default, stated here because
    # a CA rotation mid-test would be a different test): SVIDs are always
    # issued for their full TTL and the bundle does not change.
    ca_ttl = "24h"
    experimental {
        # How often the server reloads the entries that it hands to agents;
        # SPIRE's default is 5s. 1s makes a new entry reach the agents
        # within about a second.
        cache_reload_interval = "1s"
    }
}

plugins {
    # The datastore is a file in the throwaway folder.
    DataStore "sql" {
        plugin_data {
            database_type = "sqlite3"
            connection_string = %q
        }
    }
    # Agents attest with one-time tokens that the harness creates.
    NodeAttestor "join_token" {
        plugin_data {}
    }
    # The CA keys die with the server: nothing outlives a test.
    KeyManager "memory" {
        plugin_data {}
    }
}
`

func (s *SPIRE) startServer(ctx context.Context, attempt int) error {
	port, err := freePort()
	if err != nil {
		return err
	}
	data := filepath.Join(s.dir, "server-"+strconv.Itoa(attempt))
	if err := os.MkdirAll(data, 0o700); err != nil {
		return err
	}
	_ = os.Remove(s.adminSock)
	conf := fmt.Sprintf(serverConf, port, s.adminSock, TrustDomain, data, s.X509SVIDTTL.String(),
		filepath.Join(data, "datastore.sqlite3"))
	confFile := filepath.Join(data, "server.conf")
	if err := os.WriteFile(confFile, []byte(conf), 0o600); err != nil {
		return err
	}
	p, err := s.start("spire-server", "spire-server", "run", "-config", confFile)
	if err != nil {
		return err
	}
	s.server = p
	s.ServerAddress = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	if err := s.waitHealthy(ctx, p, "spire-server", "healthcheck", "-socketPath", s.adminSock); err != nil {
		s.server = nil
		return errors.Join(err, p.stop(s.opts.StopTimeout))
	}
	return nil
}

// agentConf is the whole spire-agent configuration.
const agentConf = `agent {
    data_dir = %q
    server_address = "127.0.0.1"
    server_port = "%d"
    # The Workload API socket that the workloads of this agent use.
    socket_path = %q
    trust_domain = %q
    # The server's CA, so the agent authenticates the server from the start
    # (no insecure_bootstrap).
    trust_bundle_path = %q
    join_token = %q
    log_level = "INFO"
    experimental {
        # How often the agent syncs with the server; SPIRE's default is 5s.
        # 1s makes a new entry usable, and a rotated SVID served, within a
        # second of being due.
        sync_interval = "1s"
    }
}

plugins {
    NodeAttestor "join_token" {
        plugin_data {}
    }
    # Keys in memory: the agent never restarts within a test.
    KeyManager "memory" {
        plugin_data {}
    }
    # Attests callers of the Workload API by their uid, gid, pid, path.
    WorkloadAttestor "unix" {
        plugin_data {}
    }
}
`

// StartAgent creates a join token, starts a spire-agent named name that
// attests with it, and returns once the agent is healthy. Its Workload API
// serves no SVID until RegisterWorkload adds one.
func (s *SPIRE) StartAgent(ctx context.Context, name string) (*SPIREAgent, error) {
	s.mu.Lock()
	s.agentCount++
	n := s.agentCount
	s.mu.Unlock()
	out, err := s.cli(ctx, "token", "generate", "-ttl", "600", "-output", "json")
	if err != nil {
		return nil, fmt.Errorf("framework: spire: join token for agent %s: %w", name, err)
	}
	var tok struct {
		Value string `json:"value"`
	}
	if err := json.Unmarshal(out, &tok); err != nil || tok.Value == "" {
		return nil, fmt.Errorf("framework: spire: join token for agent %s: unexpected output %q (%v)", name, out, err)
	}
	id, err := spiffeid.FromSegments(s.TrustDomain, "spire", "agent", "join_token", tok.Value)
	if err != nil {
		return nil, fmt.Errorf("framework: spire: agent %s: %w", name, err)
	}
	data := filepath.Join(s.dir, "agent-"+strconv.Itoa(n))
	if err := os.MkdirAll(data, 0o700); err != nil {
		return nil, err
	}
	a := &SPIREAgent{Name: name, ID: id, SocketPath: filepath.Join(data, "workload.sock"), s: s}
	_, port, _ := net.SplitHostPort(s.ServerAddress)
	portNum, _ := strconv.Atoi(port)
	conf := fmt.Sprintf(agentConf, data, portNum, a.SocketPath, TrustDomain, s.BundleFile, tok.Value)
	confFile := filepath.Join(data, "agent.conf")
	if err := os.WriteFile(confFile, []byte(conf), 0o600); err != nil {
		return nil, err
	}
	began := time.Now()
	if a.proc, err = s.start("spire-agent "+name, "spire-agent", "run", "-config", confFile); err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.agents = append(s.agents, a)
	s.mu.Unlock()
	if err := s.waitHealthy(ctx, a.proc, "spire-agent", "healthcheck", "-socketPath", a.SocketPath); err != nil {
		return nil, fmt.Errorf("framework: start spire-agent %s: %w%s", name, err, s.outputContext())
	}
	s.opts.Log.Info("spire-agent started", "name", name, "id", id.String(), "socket", a.SocketPath,
		"duration", time.Since(began).Round(time.Millisecond).String())
	return a, nil
}

// RegisterWorkload creates a registration entry for spiffeID, parented to
// this agent, that matches any process of the given uid (selector
// unix:uid:<uid>), and returns once the agent serves its SVID on its
// Workload API. For an in-process component, uid is os.Getuid().
func (a *SPIREAgent) RegisterWorkload(ctx context.Context, spiffeID string, uid int) error {
	id, err := spiffeid.FromString(spiffeID)
	if err != nil {
		return fmt.Errorf("framework: spire: register %q: %w", spiffeID, err)
	}
	if id.TrustDomain() != a.s.TrustDomain {
		return fmt.Errorf("framework: spire: register %s: not in trust domain %s", id, a.s.TrustDomain)
	}
	out, err := a.s.cli(ctx, "entry", "create", "-output", "json",
		"-parentID", a.ID.String(), "-spiffeID", id.String(), "-selector", "unix:uid:"+strconv.Itoa(uid))
	if err != nil {
		return fmt.Errorf("framework: spire: register %s on agent %s: %w", id, a.Name, err)
	}
	var res struct {
		Results []struct {
			Status struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			} `json:"status"`
		} `json:"results"`
	}
	if err := json.Unmarshal(out, &res); err != nil || len(res.Results) != 1 {
		return fmt.Errorf("framework: spire: register %s on agent %s: unexpected output %q (%v)", id, a.Name, out, err)
	}
	if st := res.Results[0].Status; st.Code != 0 {
		return fmt.Errorf("framework: spire: register %s on agent %s: code %d: %s", id, a.Name, st.Code, st.Message)
	}
	return a.WaitForSVID(ctx, id)
}

// WaitForSVID returns once the agent's Workload API serves an X509-SVID for
// id to this process, or with an error when ctx ends or StartTimeout passes.
func (a *SPIREAgent) WaitForSVID(ctx context.Context, id spiffeid.ID) error {
	ctx, cancel := context.WithTimeout(ctx, a.s.opts.StartTimeout)
	defer cancel()
	began := time.Now()
	var last error
	for {
		fctx, fcancel := context.WithTimeout(ctx, 5*time.Second)
		x, err := workloadapi.FetchX509Context(fctx, workloadapi.WithAddr(a.Endpoint()))
		fcancel()
		if err == nil {
			if slices.ContainsFunc(x.SVIDs, func(s *x509svid.SVID) bool { return s.ID == id }) {
				a.s.opts.Log.Info("spire workload registered", "agent", a.Name, "id", id.String(),
					"duration", time.Since(began).Round(time.Millisecond).String())
				return nil
			}
			err = fmt.Errorf("served %d other SVIDs", len(x.SVIDs))
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("framework: spire: agent %s does not serve %s: %w (last: %v)%s",
				a.Name, id, ctx.Err(), last, a.s.outputContext())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Output returns the last 64 KiB that the server and agents logged, each
// line prefixed with the process's name. Show it when a test fails.
func (s *SPIRE) Output() string {
	if s == nil {
		return ""
	}
	return s.tail.text()
}

// Stop stops the agents, then the server, and removes the temporary folder.
// It is safe on a nil SPIRE and safe to call more than once.
func (s *SPIRE) Stop() error {
	if s == nil {
		return nil
	}
	s.stopOnce.Do(func() {
		s.mu.Lock()
		agents := s.agents
		s.agents = nil
		s.mu.Unlock()
		errs := make([]error, len(agents))
		var wg sync.WaitGroup
		for i, a := range agents {
			wg.Go(func() {
				if err := a.proc.stop(s.opts.StopTimeout); err != nil {
					errs[i] = fmt.Errorf("spire-agent %s: %w", a.Name, err)
				}
			})
		}
		wg.Wait()
		if s.server != nil {
			if err := s.server.stop(s.opts.StopTimeout); err != nil {
				errs = append(errs, fmt.Errorf("spire-server: %w", err))
			}
		}
		errs = append(errs, os.RemoveAll(s.dir))
		if err := errors.Join(errs...); err != nil {
			s.stopErr = fmt.Errorf("framework: stop spire: %w", err)
		}
	})
	return s.stopErr
}

// cli runs `spire-server <command> <sub> <flags>` against the server's admin
// socket and returns its stdout.
func (s *SPIRE) cli(ctx context.Context, command, sub string, flags ...string) ([]byte, error) {
	args := append([]string{command, sub, "-socketPath", s.adminSock}, flags...)
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(s.bin, "spire-server"), args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("spire-server %s %s: %w: %s", command, sub, err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// waitHealthy runs `<bin> <args>` (a healthcheck) until it succeeds, p
// exits, ctx ends or StartTimeout passes.
func (s *SPIRE) waitHealthy(ctx context.Context, p *spireProcess, bin string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, s.opts.StartTimeout)
	defer cancel()
	var last []byte
	for {
		cmd := exec.CommandContext(ctx, filepath.Join(s.bin, bin), args...)
		out, err := cmd.CombinedOutput()
		if err == nil {
			return nil
		}
		last = out
		select {
		case <-p.done:
			return fmt.Errorf("%s exited: %w", p.name, p.err)
		case <-ctx.Done():
			return fmt.Errorf("%s not healthy: %w (last healthcheck: %s)", p.name, ctx.Err(), strings.TrimSpace(string(last)))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (s *SPIRE) start(name, bin string, args ...string) (*spireProcess, error) {
	path := filepath.Join(s.bin, bin)
	var out io.Writer = s.tail
	if s.opts.Output != nil {
		out = io.MultiWriter(s.tail, s.opts.Output)
	}
	out = &prefixWriter{w: out, prefix: name + ": ", bol: true}
	// On Linux with setpriv(1) the process gets SIGTERM when the test
	// process dies without calling Stop, as the API servers do (see
	// launchers).
	cmd := exec.Command(path, args...)
	if setpriv, err := exec.LookPath("setpriv"); err == nil && runtime.GOOS == "linux" {
		cmd = exec.Command(setpriv, append([]string{"--pdeathsig", "TERM", "--", path}, args...)...)
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Dir = s.dir
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("framework: start %s: %w", name, err)
	}
	p := &spireProcess{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// outputContext returns the last few KiB of output formatted to follow an
// error message; Output has more.
func (s *SPIRE) outputContext() string {
	out := strings.TrimSpace(s.tail.text())
	if len(out) > 4<<10 {
		out = out[len(out)-4<<10:]
		if i := strings.IndexByte(out, '\n'); i >= 0 {
			out = out[i+1:]
		}
	}
	if out == "" {
		return ""
	}
	return "\nlast output of spire-server and spire-agents:\n" + out
}

// spireProcess is a running spire-server or spire-agent.
type spireProcess struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error // set before done closes
}

// stop sends SIGTERM and waits up to timeout before it kills the process.
// A process that exits on SIGTERM has stopped cleanly.
func (p *spireProcess) stop(timeout time.Duration) error {
	select {
	case <-p.done:
		return fmt.Errorf("exited before Stop: %w", p.err)
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("killed after %s without exiting on SIGTERM", timeout)
	}
}

// resolveSPIRE returns the folder with spire-server and spire-agent, or an
// error wrapping ErrMissingSPIRE.
func resolveSPIRE(dir string) (string, error) {
	source := "SPIREOptions.BinDir"
	if dir == "" {
		dir, source = os.Getenv(SPIREEnv), SPIREEnv
	}
	if dir == "" {
		return "", fmt.Errorf("framework: %s is empty: %w", SPIREEnv, ErrMissingSPIRE)
	}
	for _, bin := range []string{"spire-server", "spire-agent"} {
		p := filepath.Join(dir, bin)
		fi, err := os.Stat(p)
		if err != nil {
			return "", fmt.Errorf("framework: %s=%q: %w (%w)", source, dir, ErrMissingSPIRE, err)
		}
		if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
			return "", fmt.Errorf("framework: %s=%q: %s is not an executable file: %w", source, dir, p, ErrMissingSPIRE)
		}
	}
	return dir, nil
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("framework: pick a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// text returns what the buffer holds.
func (t *tailBuffer) text() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// prefixWriter writes prefix at the start of every line.
type prefixWriter struct {
	mu     sync.Mutex
	w      io.Writer
	prefix string
	bol    bool // at the beginning of a line
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []byte
	for _, c := range b {
		if p.bol {
			out = append(out, p.prefix...)
		}
		out = append(out, c)
		p.bol = c == '\n'
	}
	if _, err := p.w.Write(out); err != nil {
		return 0, err
	}
	return len(b), nil
}
