package framework

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Process is a credbroker binary that a test runs as a child process.
type Process struct {
	cmd    *exec.Cmd
	done   chan struct{}
	mu     sync.Mutex
	output strings.Builder
	err    error
}

// Signal sends sig to the process, such as syscall.SIGKILL.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Wait waits for the process to exit and returns its error.
func (p *Process) Wait() error {
	<-p.done
	return p.err
}

// Output is what the process wrote to stdout and stderr so far; nothing
// for a nil Process, such as a failed start's.
func (p *Process) Output() string {
	if p == nil {
		return ""
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.output.String()
}

func (p *Process) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.output.Write(b)
}

// Stop kills the process if it still runs and waits for it. It does
// nothing on a nil Process, such as a failed start's, so that a cleanup
// registered for an earlier start of it need not check.
func (p *Process) Stop() {
	if p == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// StartProcess runs bin with args, collecting its output.
func StartProcess(bin string, args ...string) (*Process, error) {
	return startProcess(bin, nil, args)
}

// startProcess is StartProcess with env added to the test's environment.
func startProcess(bin string, env, args []string) (*Process, error) {
	p := &Process{done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	if len(env) > 0 {
		p.cmd.Env = append(os.Environ(), env...)
	}
	p.cmd.Stdout, p.cmd.Stderr = p, p
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("framework: start %s: %w", filepath.Base(bin), err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// AgentProcessOptions configure StartAgentProcess.
type AgentProcessOptions struct {
	// Bin is the spoke-agent binary; required.
	Bin string
	// SpokeServer replaces the spoke's URL, such as a proxy's.
	SpokeServer string
	// BrokerAddresses replace the brokers' agent addresses.
	BrokerAddresses []string
	// Args are more flags.
	Args []string
	// ClusterProfile is the name, in FleetNamespace, of the ClusterProfile
	// the agent serves (its --cluster and SVID). Default: spoke's name.
	ClusterProfile string
	// Kubeconfig, when set, is the agent's --kubeconfig, such as one of
	// Cluster.WriteServiceAccountKubeconfig for the ServiceAccount that
	// deploy/spoke creates; the agent's account is then left as it is.
	// Default: a kubeconfig of AgentNamespace/AgentServiceAccount with
	// AgentRules, created if missing.
	Kubeconfig string
}

// StartAgentProcess runs the spoke-agent binary for spoke, as its default
// agent ID, with the flags an operator would pass: a kubeconfig of the
// agent's spoke ServiceAccount, SVID files, the brokers and the cluster.
// It returns once the process runs; wait for its stream with
// Deployment.Connected-style checks.
func (d *Deployment) StartAgentProcess(ctx context.Context, spoke *Cluster, opts AgentProcessOptions) (*Process, error) {
	profile := spoke.Name
	if opts.ClusterProfile != "" {
		profile = opts.ClusterProfile
	}
	id := AgentID(profile)
	kubeconfig := opts.Kubeconfig
	if kubeconfig == "" {
		if err := d.ensureAgentAccount(ctx, spoke); err != nil {
			return nil, err
		}
		tok, err := spoke.Token(ctx, AgentNamespace, AgentServiceAccount, nil, time.Hour)
		if err != nil {
			return nil, err
		}
		server := spoke.Server
		if opts.SpokeServer != "" {
			server = opts.SpokeServer
		}
		// A file of each process's own: a second agent of the profile,
		// started while the first still reads its file, must not rewrite it.
		kubeconfig = filepath.Join(d.dir, fmt.Sprintf("agent-process-%s-%d.kubeconfig", profile, agentProcesses.Add(1)))
		if err := clientcmd.WriteToFile(clientcmdapi.Config{
			Clusters:       map[string]*clientcmdapi.Cluster{"spoke": {Server: server, CertificateAuthorityData: spoke.CAData}},
			AuthInfos:      map[string]*clientcmdapi.AuthInfo{"agent": {Token: tok}},
			Contexts:       map[string]*clientcmdapi.Context{"spoke": {Cluster: "spoke", AuthInfo: "agent"}},
			CurrentContext: "spoke",
		}, kubeconfig); err != nil {
			return nil, err
		}
	}
	cert, key, err := d.newAgentSVID(spoke, id, d.CA, time.Hour)
	if err != nil {
		return nil, err
	}
	brokers := opts.BrokerAddresses
	if len(brokers) == 0 {
		for _, b := range d.Brokers {
			brokers = append(brokers, b.AgentAddr())
		}
	}
	args := append([]string{
		"--kubeconfig=" + kubeconfig,
		"--broker-address=" + strings.Join(brokers, ","),
		"--trust-domain=" + TrustDomain,
		"--svid-cert-file=" + cert, "--svid-key-file=" + key, "--trust-bundle-file=" + d.CAFile,
		"--cluster=" + FleetNamespace + "/" + profile,
		"--metrics-address=127.0.0.1:0",
	}, opts.Args...)
	return StartProcess(opts.Bin, args...)
}

// BrokerProcessOptions configure StartBrokerProcess.
type BrokerProcessOptions struct {
	// Bin is the broker binary; required.
	Bin string
	// ExchangeAddress, AgentAddress and MetricsAddress are the broker's
	// listeners; pick fixed ports for a broker that restarts.
	ExchangeAddress, AgentAddress, MetricsAddress string
	// Args are more flags.
	Args []string
	// Env is added to the broker's environment, such as GOMEMLIMIT.
	Env []string
	// Kubeconfig, when set, is the broker's --kubeconfig, such as one of
	// Cluster.WriteServiceAccountKubeconfig for the ServiceAccount that
	// deploy/hub creates. Default: an admin kubeconfig.
	Kubeconfig string
	// TriggerLeaseName is the broker's --trigger-lease-name, such as one
	// that two processes share as replicas. Default: a Lease of its own,
	// so that the process runs the revocation triggers of the agents it
	// alone serves, whatever other broker of the hub holds another.
	TriggerLeaseName string
}

// brokerProcesses counts the brokers that tests start (processes, and
// in-process ones with BrokerConfig), to name their Leases and files;
// agentProcesses counts the agent processes, to name their files.
var brokerProcesses, agentProcesses atomic.Int64

// ownTriggerLease names a triggers Lease that no other broker of the hub
// campaigns for.
func ownTriggerLease() string {
	return fmt.Sprintf("credbroker-triggers-%d-%d", os.Getpid(), brokerProcesses.Add(1))
}

// bindTimeout bounds StartBrokerProcess's wait for the process to listen.
const bindTimeout = 30 * time.Second

// StartBrokerProcess runs the broker binary against the deployment's hub,
// with the deployment's serving certificate, SVID and trust bundle, and the
// flags an operator would pass. Its hub credential is opts.Kubeconfig, by
// default an admin kubeconfig.
//
// It returns once the process listens on its addresses. These are picked
// before the process binds them (FreeAddr), or are those of a broker that
// restarts on them, so another process may take one in between; the
// broker then exits at once, and StartBrokerProcess starts it again, a
// few times, before it returns an error that wraps ErrAddrInUse.
func (d *Deployment) StartBrokerProcess(opts BrokerProcessOptions) (*Process, error) {
	kubeconfig := opts.Kubeconfig
	if kubeconfig == "" {
		// A file of each process's own: a broker that starts meanwhile
		// must not rewrite it while this one reads it.
		data, err := d.Env.Hub.Kubeconfig()
		if err != nil {
			return nil, err
		}
		kubeconfig = filepath.Join(d.dir, fmt.Sprintf("broker-process-%d.kubeconfig", brokerProcesses.Add(1)))
		if err := os.WriteFile(kubeconfig, data, 0o600); err != nil {
			return nil, fmt.Errorf("framework: write kubeconfig: %w", err)
		}
	}
	cfg := d.brokerCfg
	leaseName := opts.TriggerLeaseName
	if leaseName == "" {
		leaseName = ownTriggerLease()
	}
	args := append([]string{
		"--kubeconfig=" + kubeconfig,
		"--exchange-address=" + opts.ExchangeAddress,
		"--agent-address=" + opts.AgentAddress,
		"--metrics-address=" + opts.MetricsAddress,
		"--tls-cert-file=" + d.tlsCert, "--tls-key-file=" + d.tlsKey,
		"--svid-cert-file=" + cfg.SVIDCertFile, "--svid-key-file=" + cfg.SVIDKeyFile, "--trust-bundle-file=" + d.CAFile,
		"--trust-domain=" + TrustDomain,
		"--mint-timeout=" + cfg.MintTimeout.String(),
		"--agent-keepalive-time=" + cfg.AgentKeepaliveTime.String(),
		"--agent-keepalive-timeout=" + cfg.AgentKeepaliveTimeout.String(),
		// The tests start a broker before its agents and wait until it is
		// ready; opts.Args may set a window again.
		"--agent-reconnect-window=0s",
		"--trigger-lease-name=" + leaseName,
	}, opts.Args...)
	var errs []error
	for attempt := 1; attempt <= startAttempts; attempt++ {
		p, err := startProcess(opts.Bin, opts.Env, args)
		if err != nil {
			return nil, err
		}
		err = p.waitBound(opts.ExchangeAddress, opts.AgentAddress, opts.MetricsAddress)
		if err == nil {
			return p, nil
		}
		p.Stop()
		errs = append(errs, fmt.Errorf("attempt %d: %w", attempt, err))
		if !errors.Is(err, ErrAddrInUse) || attempt == startAttempts {
			break
		}
		// A pause, not synchronization: a port that a connection holds is
		// soon free again.
		time.Sleep(time.Second)
	}
	return nil, fmt.Errorf("framework: start broker: %w", errors.Join(errs...))
}

// ErrAddrInUse is wrapped by the error of a process that could not listen
// on an address because another process held it.
var ErrAddrInUse = errors.New("address already in use")

// AddrInUse reports whether the process has exited because an address it
// was to listen on was taken: its output says so.
func (p *Process) AddrInUse() bool {
	select {
	case <-p.done:
		return strings.Contains(p.Output(), "address already in use")
	default:
		return false
	}
}

// waitBound waits, for up to bindTimeout, until the process listens on the
// ports of addrs (empty ones and port 0 aside) or has exited. Where /proc
// does not tell which sockets the process holds (not Linux), it returns at
// once.
func (p *Process) waitBound(addrs ...string) error {
	var want []int
	for _, a := range addrs {
		if a == "" {
			continue
		}
		_, port, err := net.SplitHostPort(a)
		if err != nil {
			return fmt.Errorf("framework: address %q: %w", a, err)
		}
		n, err := strconv.Atoi(port)
		if err != nil {
			return fmt.Errorf("framework: address %q: %w", a, err)
		}
		if n != 0 {
			want = append(want, n)
		}
	}
	if runtime.GOOS != "linux" || len(want) == 0 {
		return nil
	}
	name := filepath.Base(p.cmd.Path)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(bindTimeout)
	for {
		select {
		case <-p.done:
			if p.AddrInUse() {
				return fmt.Errorf("%s could not listen on one of %v, which another process took since it was picked free (FreeAddr) or since its last run: %w%s",
					name, addrs, ErrAddrInUse, p.TailContext(tailLines))
			}
			return fmt.Errorf("%s exited before it listened on %v: %v%s", name, addrs, p.err, p.TailContext(tailLines))
		case <-deadline:
			return fmt.Errorf("%s does not listen on %v after %s%s", name, addrs, bindTimeout, p.TailContext(tailLines))
		case <-tick.C:
		}
		// A process that has just exited has no /proc entry: done tells.
		ports := listeningPorts(p.cmd.Process.Pid)
		if !slices.ContainsFunc(want, func(port int) bool { return !ports[port] }) {
			return nil
		}
	}
}

// listeningPorts returns the TCP ports on which process pid listens, from
// Linux's /proc: the listening sockets of its network namespace whose
// inodes are among its open files.
func listeningPorts(pid int) map[int]bool {
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return nil
	}
	inodes := map[string]bool{}
	for _, fd := range fds {
		link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if inode, ok := strings.CutPrefix(link, "socket:["); err == nil && ok {
			inodes[strings.TrimSuffix(inode, "]")] = true
		}
	}
	ports := map[int]bool{}
	for _, table := range []string{"tcp", "tcp6"} {
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		if err != nil {
			continue // no IPv6, say
		}
		for _, line := range strings.Split(string(raw), "\n")[1:] {
			// sl, local_address (hex IP:port), rem_address, st (0A is
			// LISTEN), tx:rx queues, tr:when, retrnsmt, uid, timeout, inode.
			f := strings.Fields(line)
			if len(f) < 10 || f[3] != "0A" || !inodes[f[9]] {
				continue
			}
			_, hexPort, _ := strings.Cut(f[1], ":")
			if port, err := strconv.ParseUint(hexPort, 16, 16); err == nil {
				ports[int(port)] = true
			}
		}
	}
	return ports
}

// ServingCertFiles are the PEM certificate and key files of the brokers'
// exchange port, for a baseline server that must present the same
// certificate.
func (d *Deployment) ServingCertFiles() (certFile, keyFile string) { return d.tlsCert, d.tlsKey }

// freeAddrs are the addresses FreeAddr has handed out.
var freeAddrs struct {
	sync.Mutex
	given map[string]bool
}

// FreeAddr returns a loopback host:port that was free a moment ago, for a
// process that must listen on the same port after a restart, or that does
// not tell which port it bound (the broker binary's metrics port): a
// process that can bind 127.0.0.1:0 should.
//
// The port is free only until someone binds it. FreeAddr never hands out
// the same address twice in this process (the kernel may give a closed
// listener's port to the next one that asks, before the process it was
// picked for has bound it), but another process may take it: then the
// process it was picked for exits with "address already in use"
// (Process.AddrInUse, and StartBrokerProcess's retries).
func FreeAddr() (string, error) {
	freeAddrs.Lock()
	defer freeAddrs.Unlock()
	if freeAddrs.given == nil {
		freeAddrs.given = map[string]bool{}
	}
	for range 100 {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", err
		}
		addr := lis.Addr().String()
		if err := lis.Close(); err != nil {
			return "", err
		}
		if !freeAddrs.given[addr] {
			freeAddrs.given[addr] = true
			return addr, nil
		}
	}
	return "", fmt.Errorf("framework: 100 free loopback ports in a row were handed out before (%d so far)", len(freeAddrs.given))
}
