package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"

	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/test/framework"
)

// A consumer in a network of its own. The test process runs itself again
// in a new network namespace, where nothing but its loopback exists, as a
// consumer on a hub network that reaches the brokers and no spoke: each of
// the brokers' ports it needs is bridged in over a Unix socket, and the
// spoke API server's address is not. There, the consumer builds its client
// with cluster-inventory-api's pkg/access, a provider file and the shipped
// credbroker-plugin, as any fleet controller does.
const (
	// netnsHelperEnv, when set, makes the test binary the consumer: it
	// names the JSON file of its netnsJob.
	netnsHelperEnv = "CREDBROKER_E2E_NETNS_CONSUMER"
)

// netnsJob is what the consumer in the namespace is asked to do.
type netnsJob struct {
	// Bridges maps each host:port to listen on in the namespace to the
	// Unix socket that leads to that address outside it.
	Bridges map[string]string
	// Spoke is the spoke API server's host:port, which must not answer.
	Spoke string
	// ProviderFile and ClusterProfile make the client, as pkg/access does.
	ProviderFile   string
	ClusterProfile *v1alpha1.ClusterProfile
}

// netnsResult is what the consumer reports, as JSON on standard output.
type netnsResult struct {
	Direct     string // the error of a direct connection to the spoke
	Namespaces int    // listed through the broker
	Error      string
}

// runNetnsConsumer is the consumer's side; it returns the exit code.
func runNetnsConsumer(jobFile string) int {
	var res netnsResult
	if err := netnsConsumer(jobFile, &res); err != nil {
		res.Error = err.Error()
	}
	_ = json.NewEncoder(os.Stdout).Encode(res)
	return 0
}

func netnsConsumer(jobFile string, res *netnsResult) error {
	raw, err := os.ReadFile(jobFile)
	if err != nil {
		return err
	}
	var job netnsJob
	if err := json.Unmarshal(raw, &job); err != nil {
		return err
	}
	if err := loopbackUp(); err != nil {
		return fmt.Errorf("bring up lo: %w", err)
	}
	for addr, sock := range job.Bridges {
		lis, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		go bridge(lis, "unix", sock)
	}
	conn, err := net.DialTimeout("tcp", job.Spoke, 2*time.Second)
	if err == nil {
		_ = conn.Close()
		res.Direct = ""
	} else {
		res.Direct = err.Error()
	}
	cfg, err := access.NewFromFile(job.ProviderFile)
	if err != nil {
		return err
	}
	rc, err := cfg.BuildConfigFromCP(job.ClusterProfile)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	res.Namespaces = len(list.Items)
	return nil
}

// loopbackUp sets lo up: a new network namespace has it down.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// bridge copies each connection lis accepts to a new connection to
// network/addr, both ways, until lis closes.
func bridge(lis net.Listener, network, addr string) {
	relay(lis, func() (net.Conn, error) { return net.Dial(network, addr) })
}

// relay copies each connection lis accepts to a new connection that dial
// opens, both ways, until lis closes.
func relay(lis net.Listener, dial func() (net.Conn, error)) {
	for {
		in, err := lis.Accept()
		if err != nil {
			return
		}
		go func() {
			defer in.Close()
			out, err := dial()
			if err != nil {
				return
			}
			defer out.Close()
			var wg sync.WaitGroup
			wg.Go(func() { _, _ = io.Copy(out, in); closeWrite(out) })
			_, _ = io.Copy(in, out)
			closeWrite(in)
			wg.Wait()
		}()
	}
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}

// A spoke that the consumer cannot reach: its direct connection fails in
// the consumer's network, and the same consumer lists the spoke's
// namespaces through the broker's API proxy, with pkg/access and the
// shipped plugin, the ClusterProfile's published server being the proxy.
func TestUnreachableSpokeThroughTheDataPath(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("a network namespace of its own needs root (CI runs as root)")
	}
	ctx := context.Background()
	spoke := env.Spokes[1]
	name, _ := dataPathProfile(t, spoke, "unreachable")
	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "reader", c.username())
	require.NoError(t, spoke.Grant(ctx, "", framework.ServiceAccountSubject(ns, "reader"), []rbacv1.PolicyRule{listNS}))
	cp, err := env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Get(ctx, name, metav1.GetOptions{})
	require.NoError(t, err)

	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	providers, err := json.Marshal(access.Config{Providers: []access.Provider{{
		Name: plugin.Name,
		ExecConfig: &clientcmdapi.ExecConfig{
			APIVersion: "client.authentication.k8s.io/v1", Command: pluginBin, ProvideClusterInfo: true,
			Args: []string{"--broker-address", deployment.Broker.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", tokenFile},
		},
	}}})
	require.NoError(t, err)
	job := netnsJob{Bridges: map[string]string{}, ProviderFile: filepath.Join(dir, "providers.json"), ClusterProfile: cp}
	require.NoError(t, os.WriteFile(job.ProviderFile, providers, 0o600))
	u, err := url.Parse(spoke.Server)
	require.NoError(t, err)
	job.Spoke = u.Host
	for i, addr := range []string{deployment.Broker.ExchangeAddr(), deployment.Broker.ProxyAddr()} {
		sock := filepath.Join(dir, fmt.Sprintf("bridge-%d.sock", i))
		lis, err := net.Listen("unix", sock)
		require.NoError(t, err)
		t.Cleanup(func() { _ = lis.Close() })
		go bridge(lis, "tcp", addr)
		job.Bridges[addr] = sock
	}
	jobFile := filepath.Join(dir, "job.json")
	raw, err := json.Marshal(job)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(jobFile, raw, 0o600))

	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), netnsHelperEnv+"="+jobFile)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "the consumer in its network namespace: %s", stderr.String())
	var res netnsResult
	require.NoError(t, json.Unmarshal(out, &res), "%s", out)
	t.Logf("in the consumer's network: direct connection to %s: %s; namespaces listed through the broker: %d", job.Spoke, res.Direct, res.Namespaces)
	assert.NotEmpty(t, res.Direct, "the consumer reached the spoke directly")
	assert.Empty(t, res.Error, "the consumer could not list through the broker")
	assert.Positive(t, res.Namespaces)
}
