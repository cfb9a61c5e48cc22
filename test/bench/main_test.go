package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/credbroker/credbroker/test/framework"
)

// The environment every scenario shares: a hub and one spoke, a deployment
// (its in-process broker stays idle: every agent and consumer here uses
// the broker process), and the binaries under test.
var (
	env        *framework.Env
	deployment *framework.Deployment
	spoke      *framework.Cluster
	// brokerBin and agentBin are the shipped binaries: those `make build`
	// wrote to $CREDBROKER_BENCH_BIN, else built from this tree.
	brokerBin, agentBin string
	// pluginBin is the shipped credbroker-plugin, as brokerBin.
	pluginBin string
	// workDir holds the certificates, kubeconfigs, audit log and profiles.
	workDir string
)

func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == echoCommand {
		os.Exit(serveEcho(os.Args[2:]))
	}
	if os.Getenv("CREDBROKER_BENCH") == "" {
		fmt.Println("bench: skipped; `make bench` runs it (CREDBROKER_BENCH=1)")
		os.Exit(0)
	}
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var err error
	if workDir, err = os.MkdirTemp("", "credbroker-bench-"); err != nil {
		return fail(err)
	}
	defer os.RemoveAll(workDir)

	if dir := os.Getenv("CREDBROKER_BENCH_BIN"); dir != "" {
		brokerBin, agentBin = filepath.Join(dir, "broker"), filepath.Join(dir, "spoke-agent")
		pluginBin = filepath.Join(dir, "credbroker-plugin")
	} else {
		brokerBin, agentBin = filepath.Join(workDir, "broker"), filepath.Join(workDir, "spoke-agent")
		pluginBin = filepath.Join(workDir, "credbroker-plugin")
		if err := framework.Build(ctx, workDir, "spoke-agent", "broker", "credbroker-plugin"); err != nil {
			return fail(err)
		}
	}
	if env, err = framework.Start(ctx, framework.Options{Spokes: 1}); err != nil {
		return fail(err)
	}
	defer env.Stop()
	spoke = env.Spokes[0]
	if deployment, err = framework.StartDeployment(ctx, env, framework.DeploymentOptions{Dir: workDir}); err != nil {
		return fail(err)
	}
	defer deployment.Stop()
	return m.Run()
}

func fail(err error) int {
	fmt.Fprintln(os.Stderr, "bench:", err)
	return 1
}
