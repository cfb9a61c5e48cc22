package publish

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
)

func TestValidServer(t *testing.T) {
	for _, tt := range []struct {
		server string
		ok     bool
	}{
		{"https://spoke.example:6443", true},
		{"https://spoke.example", true},
		{"https://10.0.0.1:6443/clusters/fleet/prod", true},
		{"https://[::1]:6443", true},
		{"HTTPS://spoke.example", true}, // schemes are case-insensitive
		{"", false},
		{"http://spoke.example:6443", false},
		{"spoke.example:6443", false},
		{"https://", false},
		{"https://:6443", false},
		{"https:///path", false},
		{"https:spoke.example", false},
		{"https://user:pass@spoke.example", false},
		{"https://spoke.example?x=1", false},
		{"https://spoke.example?", false},
		{"https://spoke.example#frag", false},
		{"https://spoke.example:6443\n", false},
		{"unix:///var/run/spoke.sock", false},
	} {
		t.Run(tt.server, func(t *testing.T) {
			assert.Equal(t, tt.ok, ValidServer(tt.server))
		})
	}
}

func provider(server string, ca string) *v1alpha1.AccessProvider {
	return &v1alpha1.AccessProvider{Name: "credbroker", Cluster: clientcmdv1.Cluster{Server: server, CertificateAuthorityData: []byte(ca)}}
}

func TestDecide(t *testing.T) {
	const a, b = "https://a.example:6443", "https://b.example:6443"
	ad := func(server, ca string) Advertisement {
		return Advertisement{Server: server, CAData: []byte(ca), Streams: 1}
	}
	for _, tt := range []struct {
		name     string
		pinned   *v1alpha1.AccessProvider
		ads      []Advertisement
		server   string
		ca       string
		conflict string
	}{
		{name: "nothing advertised, nothing published"},
		{name: "one server, first publication", ads: []Advertisement{ad(a, "ca")}, server: a, ca: "ca"},
		{name: "two servers, first publication", ads: []Advertisement{ad(a, "ca"), ad(b, "ca")}, conflict: conflictAgents},
		{name: "one server, two CAs, first publication", ads: []Advertisement{ad(a, "ca"), ad(a, "other")}, conflict: conflictAgents},
		{name: "only a non-https server", ads: []Advertisement{ad("http://a.example", "")}, conflict: conflictRefused},
		{name: "a non-https server beside an https one", ads: []Advertisement{ad("http://evil.example", ""), ad(a, "ca")},
			server: a, ca: "ca", conflict: conflictRefused},
		{name: "pinned, agents agree with it", pinned: provider(a, "ca"), ads: []Advertisement{ad(a, "ca")}, server: a, ca: "ca"},
		{name: "pinned, agents advertise nothing", pinned: provider(a, "ca"), server: a, ca: "ca"},
		{name: "pinned, agents agree on another server", pinned: provider(a, "ca"), ads: []Advertisement{ad(b, "ca")},
			server: a, ca: "ca", conflict: conflictPinned},
		{name: "pinned, agents agree on another CA", pinned: provider(a, "ca"), ads: []Advertisement{ad(a, "evil")},
			server: a, ca: "ca", conflict: conflictPinned},
		{name: "pinned, agents disagree among themselves", pinned: provider(a, "ca"), ads: []Advertisement{ad(a, "ca"), ad(b, "ca")},
			server: a, ca: "ca", conflict: conflictPinned},
		{name: "pinned, a non-https server", pinned: provider(a, "ca"), ads: []Advertisement{ad("http://evil.example", "")},
			server: a, ca: "ca", conflict: conflictRefused},
		{name: "a non-https entry is not pinned", pinned: provider("http://a.example", "ca"), ads: []Advertisement{ad(b, "ca")},
			server: b, ca: "ca"},
		{name: "an entry without a server is not pinned", pinned: provider("", ""), ads: []Advertisement{ad(b, "ca")},
			server: b, ca: "ca"},
		{name: "a non-https entry, agents disagree", pinned: provider("http://a.example", "ca"),
			ads: []Advertisement{ad(a, "ca"), ad(b, "ca")}, conflict: conflictAgents},
	} {
		t.Run(tt.name, func(t *testing.T) {
			v := decide(tt.pinned, tt.ads)
			assert.Equal(t, tt.server, v.server)
			if tt.server != "" {
				assert.Equal(t, []byte(tt.ca), v.caData)
			}
			assert.Equal(t, tt.conflict, v.conflict)
		})
	}
}

// logLines is a logr sink that keeps every line.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) add(prefix, args string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, prefix+" "+args)
}

func (l *logLines) matching(msg string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, line := range l.lines {
		if strings.Contains(line, `"msg"="`+msg+`"`) {
			out = append(out, line)
		}
	}
	return out
}

const (
	conflictMsg = "agents' advertised servers are in conflict"
	resolvedMsg = "agents' advertised servers no longer conflict"
)

// The publisher never lets an agent pick the published server: agents
// that disagree publish nothing, a published entry stays when agents
// advertise another, an admin's removal (or an entry an admin wrote) is
// what changes it, and a non-https server is never published. Each
// conflict is logged once and counted while it lasts.
func TestReconcileNeverLetsAnAgentRepoint(t *testing.T) {
	ctx := context.Background()
	p, src, hub, _ := newFixture(t)
	logs := &logLines{}
	p.cfg.Log = funcr.New(logs.add, funcr.Options{})
	const honest, decoy, other = "https://spoke:6443", "https://decoy:443", "https://other:6443"
	reconcile := func() {
		t.Helper()
		_, err := p.Reconcile(ctx, key)
		require.NoError(t, err)
	}
	published := func() *v1alpha1.AccessProvider {
		entry, _ := p.observed(hub.cp)
		return entry
	}
	message := func() string {
		_, cond := p.observed(hub.cp)
		require.NotNil(t, cond)
		return cond.Message
	}

	// Two agents disagree before anything is published: nothing is.
	src.live = 2
	src.ads = []Advertisement{{Server: honest, CAData: []byte("ca"), Streams: 1}, {Server: decoy, CAData: []byte("evil"), Streams: 1}}
	reconcile()
	reconcile()
	assert.Nil(t, published(), "a server was published while the agents disagree")
	assert.Contains(t, message(), "disagree on the server or CA")
	assert.Equal(t, 1, p.Conflicts())
	lines := logs.matching(conflictMsg)
	require.Len(t, lines, 1, "one log line for one conflict")
	assert.Contains(t, lines[0], `"conflict"="agents disagree"`)
	assert.Contains(t, lines[0], `\"https://decoy:443\"`)
	assert.Contains(t, lines[0], `\"https://spoke:6443\"`)
	assert.Contains(t, lines[0], `"cluster"="fleet/prod"`)

	// The decoy goes: the honest server is published.
	src.live, src.ads = 1, []Advertisement{{Server: honest, CAData: []byte("ca"), Streams: 1}}
	reconcile()
	require.NotNil(t, published())
	assert.Equal(t, honest, published().Cluster.Server)
	assert.Equal(t, []byte("ca"), published().Cluster.CertificateAuthorityData)
	assert.Zero(t, p.Conflicts())
	assert.Len(t, logs.matching(resolvedMsg), 1)

	// A decoy connects beside it, then the honest agent goes: the entry
	// stays pinned.
	for _, ads := range [][]Advertisement{
		{{Server: honest, CAData: []byte("ca"), Streams: 1}, {Server: decoy, CAData: []byte("evil"), Streams: 1}},
		{{Server: decoy, CAData: []byte("evil"), Streams: 1}},
		{{Server: honest, CAData: []byte("evil"), Streams: 1}},
	} {
		src.live, src.ads = len(ads), ads
		reconcile()
		assert.Equal(t, honest, published().Cluster.Server)
		assert.Equal(t, []byte("ca"), published().Cluster.CertificateAuthorityData)
		assert.Contains(t, message(), "the published entry stays until an admin removes it")
		assert.Equal(t, 1, p.Conflicts())
	}
	assert.Len(t, logs.matching(conflictMsg), 4, "a changed conflict is logged again")

	// An admin removes the entry: the agents' agreed server is taken.
	src.live, src.ads = 1, []Advertisement{{Server: other, CAData: []byte("ca2"), Streams: 1}}
	reconcile()
	assert.Equal(t, honest, published().Cluster.Server, "pinned until the admin acts")
	hub.cp.Status.AccessProviders = nil
	reconcile()
	require.NotNil(t, published())
	assert.Equal(t, other, published().Cluster.Server)
	assert.Zero(t, p.Conflicts())

	// An admin writes the entry: the publisher keeps what the admin wrote.
	*published() = *provider(honest, "admin-ca")
	reconcile()
	assert.Equal(t, honest, published().Cluster.Server)
	assert.Equal(t, []byte("admin-ca"), published().Cluster.CertificateAuthorityData)
	require.Len(t, published().Cluster.Extensions, 1, "the exec extension is the publisher's to keep")
	assert.Equal(t, 1, p.Conflicts())

	// A non-https entry is never kept, and a non-https server never taken.
	*published() = *provider("http://spoke:6443", "ca")
	src.ads = []Advertisement{{Server: honest, CAData: []byte("ca"), Streams: 1}}
	reconcile()
	assert.Equal(t, honest, published().Cluster.Server)
	hub.cp.Status.AccessProviders = nil
	src.ads = []Advertisement{{Server: "http://spoke:6443", Streams: 1}}
	reconcile()
	assert.Nil(t, published(), "a non-https server was published")
	assert.Contains(t, message(), "not an https URL")
	assert.Equal(t, 1, p.Conflicts())
	assert.Contains(t, logs.matching(conflictMsg)[len(logs.matching(conflictMsg))-1], `"conflict"="advertised server is not an https URL"`)

	// The ClusterProfile goes: so does its conflict.
	hub.cp.DeletionTimestamp = &metav1.Time{}
	reconcile()
	assert.Zero(t, p.Conflicts())
}

// An entry an admin wrote is pinned whenever the broker would serve it,
// whatever its spelling: the agents cannot repoint it. One the broker
// refuses is not kept, as a non-https entry is not.
func TestReconcilePinsEveryAdminEntryTheBrokerServes(t *testing.T) {
	const decoy = "https://decoy.example:6443"
	for _, tt := range []struct {
		server string
		pinned bool
	}{
		{server: "HTTPS://spoke.example:6443", pinned: true},
		{server: "HTTPS://SPOKE.EXAMPLE", pinned: true},
		{server: "https://spoke.example:6443/k8s/clusters/c-1/", pinned: true},
		{server: "https://[2001:DB8::1]:6443", pinned: true},
		{server: "http://spoke.example:6443"},
		{server: "https://u:secret@spoke.example:6443"},
		{server: "https://spoke.example:6443?x=1"},
		{server: "https://spoke.example:6443#"},
		{server: "https://:6443"},
		{server: "https://spoke.example:0"},
	} {
		t.Run(tt.server, func(t *testing.T) {
			p, src, hub, _ := newFixture(t)
			hub.cp.Status.AccessProviders = []v1alpha1.AccessProvider{*provider(tt.server, "admin-ca")}
			src.live, src.ads = 1, []Advertisement{{Server: decoy, CAData: []byte("evil"), Streams: 1}}
			_, err := p.Reconcile(context.Background(), key)
			require.NoError(t, err)
			entry, _ := p.observed(hub.cp)
			require.NotNil(t, entry)
			if tt.pinned {
				assert.Equal(t, tt.server, entry.Cluster.Server, "an agent repointed the admin's entry")
				assert.Equal(t, []byte("admin-ca"), entry.Cluster.CertificateAuthorityData)
				assert.Equal(t, 1, p.Conflicts())
				return
			}
			assert.Equal(t, decoy, entry.Cluster.Server, "an entry the broker refuses is not kept")
		})
	}
}

// A log line names an advertised server clipped: it comes from an agent.
func TestConflictLogClipsTheServer(t *testing.T) {
	p, src, _, _ := newFixture(t)
	logs := &logLines{}
	p.cfg.Log = funcr.New(logs.add, funcr.Options{})
	long := "https://decoy.example/" + strings.Repeat("x", 10_000)
	src.live, src.ads = 2, []Advertisement{{Server: "https://spoke:6443", Streams: 1}, {Server: long, Streams: 1}}
	_, err := p.Reconcile(context.Background(), key)
	require.NoError(t, err)
	lines := logs.matching(conflictMsg)
	require.Len(t, lines, 1)
	assert.Less(t, len(lines[0]), 1024)
	assert.Contains(t, lines[0], "(10022 bytes)")
}
