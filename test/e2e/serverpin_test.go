package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	clientauthenticationv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"

	"github.com/credbroker/credbroker/pkg/plugin"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// pluginRun is what one run of the credbroker-plugin binary left behind.
type pluginRun struct {
	code           int
	stdout, stderr string
}

// runPlugin runs the real plugin binary against the first broker as client-go
// would, with KUBERNETES_EXEC_INFO naming server and, in spec.cluster.config,
// the ClusterProfile fleet/<profile>.
func runPlugin(t *testing.T, c consumer, server, profile string, args ...string) pluginRun {
	t.Helper()
	tokenFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	config, err := json.Marshal(plugin.ExecConfig{ClusterProfile: &plugin.Reference{Namespace: framework.FleetNamespace, Name: profile}})
	require.NoError(t, err)
	info, err := json.Marshal(map[string]any{
		"apiVersion": "client.authentication.k8s.io/v1",
		"kind":       "ExecCredential",
		"spec": map[string]any{
			"interactive": false,
			"cluster":     map[string]any{"server": server, "config": json.RawMessage(config)},
		},
	})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, pluginBin, append([]string{
		"--broker-address", deployment.Broker.ExchangeAddr(),
		"--ca-file", deployment.CAFile,
		"--token-file", tokenFile,
	}, args...)...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(), "KUBERNETES_EXEC_INFO=" + string(info)}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	run := pluginRun{stdout: stdout.String(), stderr: stderr.String()}
	if exitErr := (*exec.ExitError)(nil); errors.As(err, &exitErr) {
		run.code = exitErr.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return run
}

// The plugin hands a token only to the server of the ClusterProfile it got
// the token for. Whoever writes a ClusterProfile's status can point its
// access provider at any server, with an exec config naming another
// ClusterProfile; without the check a consumer that builds a client for
// that profile sends the other cluster's token to the attacker's server.
func TestPluginPinsServer(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	// Granted and opted in: the exchange itself succeeds, so only the
	// plugin's check stands between the token and the foreign server.
	c := newConsumer(t, "credbroker", spoke.Name)
	ns := optIn(t, spoke, "pinned", c.username())

	t.Run("foreign server", func(t *testing.T) {
		const attacker = "https://127.0.0.1:1"
		run := runPlugin(t, c, attacker, spoke.Name)
		assert.Equal(t, 1, run.code, "stderr: %s", run.stderr)
		assert.Empty(t, run.stdout, "no ExecCredential, and so no token, on stdout")
		assert.Contains(t, run.stderr, attacker)
		assert.Contains(t, run.stderr, spoke.Server)
		assert.Contains(t, run.stderr, framework.FleetNamespace+"/"+spoke.Name)
		assert.NotContains(t, run.stderr, c.token)
	})

	t.Run("the cluster's server in another spelling", func(t *testing.T) {
		server := "HTTPS://" + strings.TrimPrefix(spoke.Server, "https://") + "/"
		run := runPlugin(t, c, server, spoke.Name)
		require.Equal(t, 0, run.code, "stderr: %s", run.stderr)
		var ec clientauthenticationv1.ExecCredential
		require.NoError(t, json.Unmarshal([]byte(run.stdout), &ec))
		require.NotNil(t, ec.Status)
		review, err := spoke.ReviewToken(ctx, ec.Status.Token, nil)
		require.NoError(t, err)
		require.True(t, review.Authenticated, review.Error)
		assert.Equal(t, "system:serviceaccount:"+ns+":pinned", review.User.Username)
	})
}

// The broker never answers with an empty server, which the plugin could not
// check: a ClusterProfile without a server is refused before any mint.
func TestClusterProfileWithoutServer(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	ext, err := json.Marshal(plugin.ExecConfig{ClusterProfile: &plugin.Reference{Namespace: framework.FleetNamespace, Name: "no-server"}})
	require.NoError(t, err)
	// The credbroker access provider lacks its server, and no other
	// provider has one.
	_, err = env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, "no-server", &framework.Access{ProviderName: plugin.Name, CAData: spoke.CAData, ExecConfig: ext})
	require.NoError(t, err)
	// An agent on spoke that serves that ClusterProfile, so that without the
	// check the exchange would mint.
	stop, err := deployment.StartAgent(ctx, spoke, framework.AgentID("no-server"))
	require.NoError(t, err)
	t.Cleanup(stop)

	c := newConsumer(t, "credbroker", "no-server")
	ns := optIn(t, spoke, "serverless", c.username())

	_, err = exchange(t, c, &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: "no-server"}})
	st := status.Convert(err)
	assert.Equal(t, codes.FailedPrecondition, st.Code(), st.Message())
	assert.Contains(t, st.Message(), "fleet/no-server")
	assert.Contains(t, st.Message(), `"credbroker"`)
	assert.False(t, strings.Contains(logs.String(), `"msg"="minted spoke token" "spoke"="`+spoke.Name+`" "subject"="`+c.username()+`" "serviceAccount"="`+ns+`/serverless"`),
		"the agent minted a token for a ClusterProfile without a server")
}
