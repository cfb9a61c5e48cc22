package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientauthenticationv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"

	"github.com/credbroker/credbroker/pkg/agent"
	"github.com/credbroker/credbroker/pkg/broker"
	"github.com/credbroker/credbroker/pkg/plugin"
	"github.com/credbroker/credbroker/test/framework"
)

// The shipped plugin waits out the broker's rate limit instead of failing
// client-go's request. A broker of its own allows each consumer one hub
// review or mint a second, burst 1: the plugin's first exchange spends the
// burst on its TokenReview, and its SubjectAccessReview and then its mint
// are refused with a retry-after of 1s. The plugin waits as told, asks
// again, and prints a credential that the spoke accepts.
func TestPluginWaitsOutRateLimit(t *testing.T) {
	ctx := context.Background()
	spoke := env.Spokes[0]
	name := uniqueName(t, "limited")
	_, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, name, deployment.ProfileAccess(spoke, framework.FleetNamespace, name))
	require.NoError(t, err)

	audit := &exchangeAudit{refused: map[string]int{}}
	cfg := deployment.BrokerConfig()
	cfg.RateLimit, cfg.RateBurst = 1, 1
	cfg.Audit = funcr.NewJSON(func(obj string) { audit.add(obj) }, funcr.Options{})
	b, err := broker.New(cfg)
	require.NoError(t, err)
	bctx, stopBroker := context.WithCancel(context.Background())
	brokerDone := make(chan error, 1)
	go func() { brokerDone <- b.Run(bctx) }()
	t.Cleanup(func() {
		stopBroker()
		assert.NoError(t, <-brokerDone)
	})

	// The profile's agent serves this broker too, and the deployment's,
	// through which its grants are revoked when it stops.
	stopAgent, err := deployment.StartAgentWith(ctx, spoke, framework.AgentOptions{
		ID:   framework.AgentID(name),
		Tune: func(c *agent.Config) { c.BrokerAddresses = append(c.BrokerAddresses, b.AgentAddr()) },
	})
	require.NoError(t, err)
	t.Cleanup(stopAgent)
	require.EventuallyWithT(t, func(ct *assert.CollectT) {
		assert.Equal(ct, 1, b.Connected(framework.FleetNamespace, name), "agent streams of %s", name)
	},
		30*time.Second, 20*time.Millisecond, "the agent never reached the rate-limited broker")

	c := newConsumer(t, "credbroker", name)
	ns := optIn(t, spoke, "limited-reader", c.username())

	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(c.token), 0o600))
	config, err := json.Marshal(plugin.ExecConfig{ClusterProfile: &plugin.Reference{Namespace: framework.FleetNamespace, Name: name}})
	require.NoError(t, err)
	info, err := json.Marshal(clientauthenticationv1.ExecCredential{
		TypeMeta: metav1.TypeMeta{APIVersion: "client.authentication.k8s.io/v1", Kind: "ExecCredential"},
		Spec: clientauthenticationv1.ExecCredentialSpec{Cluster: &clientauthenticationv1.Cluster{
			Server: spoke.Server, CertificateAuthorityData: spoke.CAData, Config: runtime.RawExtension{Raw: config},
		}},
	})
	require.NoError(t, err)
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, pluginBin, "--broker-address", b.ExchangeAddr(), "--ca-file", deployment.CAFile, "--token-file", tokenFile)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + dir, "KUBERNETES_EXEC_INFO=" + string(info)}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	began := time.Now()
	err = cmd.Run()
	took := time.Since(began)
	assert.NotContains(t, stderr.String(), c.token)
	require.NoError(t, err, "stderr: %s", stderr.String())

	minted, _, refused := audit.take()
	t.Logf("the plugin got its token in %s; refused and waited: %v", took.Round(time.Millisecond), refused)
	assert.Positive(t, refused[codes.ResourceExhausted.String()], "the broker never refused the plugin")
	assert.Len(t, refused, 1, "refused with nothing but ResourceExhausted")
	assert.Equal(t, 1, minted)

	var ec clientauthenticationv1.ExecCredential
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &ec), "stdout: %s", stdout.String())
	require.NotNil(t, ec.Status)
	review, err := spoke.ReviewToken(ctx, ec.Status.Token, nil)
	require.NoError(t, err)
	assert.True(t, review.Authenticated)
	assert.Equal(t, "system:serviceaccount:"+ns+":limited-reader", review.User.Username)
}
