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

// New fills every default, and its bounds accept what sits exactly on them.
func TestNewDefaultsAndBounds(t *testing.T) {
	var base Config
	newFixture(t, func(c *Config) { base = *c })
	svc, err := New(base)
	require.NoError(t, err)
	c := svc.cfg
	assert.Equal(t, "credbroker", c.Audience)
	assert.Equal(t, time.Hour, c.MaxExpiration)
	assert.Equal(t, 10*time.Minute, c.MinExpiration)
	assert.Equal(t, 10*time.Second, c.AuthnTTL)
	assert.Equal(t, 10*time.Second, c.AllowTTL)
	assert.Equal(t, 2*time.Second, c.DenyTTL)
	assert.Equal(t, 5*time.Second, c.ReviewTimeout)
	assert.Equal(t, 10000, c.CacheSize)
	assert.Len(t, c.HMACKey, 32, "a random key when none is given")

	given := base
	given.HMACKey = []byte("a key of the caller's")
	given.MinExpiration, given.MaxExpiration = 15*time.Minute, 15*time.Minute
	given.DenyTTL, given.AllowTTL = 3*time.Second, 3*time.Second
	given.Registerer = prometheus.NewRegistry()
	svc, err = New(given)
	require.NoError(t, err, "MinExpiration = MaxExpiration and DenyTTL = AllowTTL are allowed")
	assert.Equal(t, []byte("a key of the caller's"), svc.cfg.HMACKey, "a given key is kept")

	for name, mutate := range map[string]func(*Config){
		"MaxExpiration under MinExpiration": func(c *Config) { c.MinExpiration, c.MaxExpiration = 20*time.Minute, 15*time.Minute },
		"MinExpiration under the floor":     func(c *Config) { c.MinExpiration = 9 * time.Minute },
		"DenyTTL over AllowTTL":             func(c *Config) { c.DenyTTL, c.AllowTTL = 4*time.Second, 3*time.Second },
	} {
		bad := base
		bad.Registerer = prometheus.NewRegistry()
		mutate(&bad)
		_, err := New(bad)
		assert.Error(t, err, name)
	}
}
