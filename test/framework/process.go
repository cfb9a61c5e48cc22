package framework

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
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

// Output is what the process wrote to stdout and stderr so far.
func (p *Process) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.output.String()
}

func (p *Process) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.output.Write(b)
}

// Stop kills the process if it still runs and waits for it.
func (p *Process) Stop() {
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
		kubeconfig = filepath.Join(d.dir, "agent-process-"+profile+".kubeconfig")
		if err := clientcmd.WriteToFile(clientcmdapi.Config{
			Clusters:       map[string]*clientcmdapi.Cluster{"spoke": {Server: server, CertificateAuthorityData: spoke.CAData}},
			AuthInfos:      map[string]*clientcmdapi.AuthInfo{"agent": {Token: tok}},
			Contexts:       map[string]*clientcmdapi.Context{"spoke": {Cluster: "spoke", AuthInfo: "agent"}},
			CurrentContext: "spoke",
		}, kubeconfig); err != nil {
			return nil, err
		}
	}
	cert, key, err := d.WriteAgentSVID(spoke, id, d.CA, time.Hour)
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

// brokerProcesses counts the broker processes started, to name their
// Leases.
var brokerProcesses atomic.Int64

// StartBrokerProcess runs the broker binary against the deployment's hub,
// with the deployment's serving certificate, SVID and trust bundle, and the
// flags an operator would pass. Its hub credential is opts.Kubeconfig, by
// default an admin kubeconfig.
func (d *Deployment) StartBrokerProcess(opts BrokerProcessOptions) (*Process, error) {
	kubeconfig := opts.Kubeconfig
	if kubeconfig == "" {
		var err error
		if kubeconfig, err = d.Env.Hub.WriteKubeconfig(d.dir); err != nil {
			return nil, err
		}
	}
	cfg := d.brokerCfg
	leaseName := opts.TriggerLeaseName
	if leaseName == "" {
		leaseName = fmt.Sprintf("credbroker-triggers-%d-%d", os.Getpid(), brokerProcesses.Add(1))
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
	return startProcess(opts.Bin, opts.Env, args)
}

// ServingCertFiles are the PEM certificate and key files of the brokers'
// exchange port, for a baseline server that must present the same
// certificate.
func (d *Deployment) ServingCertFiles() (certFile, keyFile string) { return d.tlsCert, d.tlsKey }

// FreeAddr returns a loopback host:port that was free a moment ago, for a
// process that must listen on the same port after a restart.
func FreeAddr() (string, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer lis.Close()
	return lis.Addr().String(), nil
}
