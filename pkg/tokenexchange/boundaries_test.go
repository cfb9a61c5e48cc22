package tokenexchange

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"
	"k8s.io/apimachinery/pkg/types"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
)

// The limits hold exactly at their bounds: what is at a bound is accepted,
// what is one past it is refused.
func TestBoundsAreInclusive(t *testing.T) {
	audiences := func(n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = "aud-" + strconv.Itoa(i)
		}
		return out
	}
	parse := func(auds ...string) error {
		_, err := parseRequest(&pb.ExchangeRequest{Cluster: fleetA().Cluster, Audiences: auds}, "credbroker", 10*time.Minute, time.Hour)
		return err
	}
	require.NoError(t, parse(audiences(maxAudiences)...), "exactly maxAudiences audiences")
	require.Error(t, parse(audiences(maxAudiences+1)...))
	require.NoError(t, parse(strings.Repeat("a", maxAudienceLength)), "an audience of exactly maxAudienceLength bytes")
	require.Error(t, parse(strings.Repeat("a", maxAudienceLength+1)))
	require.NoError(t, parse("with space"), "a space is printable")
	require.Error(t, parse("with\x1fcontrol"))
	require.Error(t, parse("with\x7fdelete"))

	assert.Equal(t, strings.Repeat("n", 64), clip(strings.Repeat("n", 64)), "64 bytes are kept whole")
	assert.Equal(t, strings.Repeat("n", 64)+"...", clip(strings.Repeat("n", 65)))

	// An agent may answer with the spoke's default audiences, up to
	// maxAudiences of them.
	const sub = "system:serviceaccount:spoke:reader"
	exp := t0.Add(time.Hour)
	answer := func(auds []string) *pb.MintResponse {
		return &pb.MintResponse{Token: spokeToken(sub, auds, exp, "j"), ExpirationTime: timestamppb.New(exp),
			ServiceAccount: &pb.ObjectReference{Namespace: "spoke", Name: "reader"}}
	}
	r := request{serviceAccount: types.NamespacedName{Namespace: "spoke", Name: "reader"}}
	_, err := checkAnswer(answer(audiences(maxAudiences)), r, "credbroker", t0, time.Hour)
	require.NoError(t, err, "exactly maxAudiences default audiences")
	_, err = checkAnswer(answer(audiences(maxAudiences+1)), r, "credbroker", t0, time.Hour)
	require.Error(t, err)
}

// Two services cannot share a Registerer: their metrics would collide, so
// the second New fails instead of counting into the first one's series.
func TestMetricsRegisterOnce(t *testing.T) {
	reg := prometheus.NewRegistry()
	var cfg Config
	newFixture(t, func(c *Config) { c.Registerer = reg; cfg = *c })
	_, err := New(cfg)
	require.ErrorContains(t, err, "register")

	cfg.Registerer = prometheus.NewRegistry()
	_, err = New(cfg)
	require.NoError(t, err, "the same config with a registry of its own")
}
