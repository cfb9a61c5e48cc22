package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/credbroker/credbroker/pkg/grants"
	"github.com/credbroker/credbroker/pkg/identity"
	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// floodAgent is a compromised agent of its own ClusterProfile: it holds a
// valid SVID for it and talks the wire protocol by hand to the first broker
// replica, over real SPIFFE mTLS.
type floodAgent struct {
	cluster string
	client  pb.AgentTunnelClient
}

// newFloodAgent creates the ClusterProfile fleet/<cluster>, pointing at a
// real spoke, and dials the first broker with its agent's SVID. The
// ClusterProfile is deleted when the test ends.
func newFloodAgent(t *testing.T, cluster string) *floodAgent {
	t.Helper()
	ctx := context.Background()
	if _, err := env.Hub.CreateClusterProfile(ctx, framework.FleetNamespace, cluster, deployment.ProfileAccess(env.Spokes[0], framework.FleetNamespace, cluster)); err != nil && !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		_ = env.Hub.Inventory.ApisV1alpha1().ClusterProfiles(framework.FleetNamespace).Delete(context.Background(), cluster, metav1.DeleteOptions{})
	})
	certPEM, keyPEM, err := deployment.CA.IssueSVID(framework.AgentID(cluster), time.Hour)
	require.NoError(t, err)
	svid, err := x509svid.Parse(certPEM, keyPEM)
	require.NoError(t, err)
	bundle, err := x509bundle.Parse(deployment.CA.TrustDomain(), deployment.CA.BundlePEM())
	require.NoError(t, err)
	creds := identity.ClientCredentials(svid, bundle, spiffeid.RequireFromPath(deployment.CA.TrustDomain(), "/broker"))
	conn, err := grpc.NewClient(deployment.Broker.AgentAddr(), grpc.WithTransportCredentials(creds))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	a := &floodAgent{cluster: cluster, client: pb.NewAgentTunnelClient(conn)}
	// The broker's informer may not know the ClusterProfile yet.
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		s, err := a.open(ctx, &pb.Hello{AgentVersion: "flood"})
		if !assert.NoError(c, err, "admitting the fake agent of %s", cluster) {
			return
		}
		s.close()
	}, 10*time.Second, 50*time.Millisecond, "the broker did not admit the fake agent of %s", cluster)
	return a
}

func (a *floodAgent) ref() *pb.ObjectReference {
	return &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: a.cluster}
}

func (a *floodAgent) key() types.NamespacedName {
	return types.NamespacedName{Namespace: framework.FleetNamespace, Name: a.cluster}
}

// floodStream is one admitted stream; done closes when the broker ends it,
// with its code.
type floodStream struct {
	stream grpc.BidiStreamingClient[pb.AgentFrame, pb.BrokerFrame]
	cancel context.CancelFunc
	done   chan struct{}
	code   codes.Code
}

func (s *floodStream) close() {
	s.cancel()
	<-s.done
}

func (s *floodStream) closed() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// open sends hello on a new stream and returns once the broker admitted it.
func (a *floodAgent) open(ctx context.Context, hello *pb.Hello) (*floodStream, error) {
	sctx, cancel := context.WithCancel(ctx)
	stream, err := framework.AdmitFakeAgentHello(sctx, a.client, hello)
	if err != nil {
		cancel()
		return nil, err
	}
	s := &floodStream{stream: stream, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		for {
			if _, err := stream.Recv(); err != nil {
				s.code = status.Code(err)
				return
			}
		}
	}()
	return s, nil
}

// flood sends update(i) for i < n as grant updates, each once the last was
// taken (the registry holds its first grant) or refused (the broker closed
// the stream), opening a new stream whenever the broker closed the last,
// and returns the codes the broker closed streams with.
func (a *floodAgent) flood(t *testing.T, n int, update func(i int) *pb.GrantUpdate) map[codes.Code]int {
	t.Helper()
	ctx := context.Background()
	closes := map[codes.Code]int{}
	var cur *floodStream
	end := func() {
		closes[cur.code]++
		cur.cancel()
		cur = nil
	}
	for i := range n {
		if cur != nil && cur.closed() {
			end()
		}
		if cur == nil {
			var err error
			cur, err = a.open(ctx, &pb.Hello{AgentVersion: "flood"})
			require.NoError(t, err)
		}
		u := update(i)
		if err := cur.stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_GrantUpdate{GrantUpdate: u}}); err != nil {
			<-cur.done
			end()
			continue
		}
		// The last grant of each update is one the broker takes.
		id := u.GetAdded()[len(u.GetAdded())-1].GetCredentialId()
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			assert.True(c, cur.closed() || len(deployment.Broker.Grants().Select(grants.Selector{CredentialID: id})) > 0,
				"the stream is open and the broker lists no grant %s", id)
		}, 10*time.Second, time.Millisecond, "the broker neither took nor refused grant update %d", i)
	}
	if cur != nil {
		// Whatever was sent has been read once the broker answers on
		// the stream, or closed it: a goodbye is answered by nothing, so
		// wait for the registry instead (the caller does).
		cur.cancel()
		<-cur.done
		if cur.code != codes.Canceled {
			closes[cur.code]++
		}
	}
	return closes
}

// floodGrant is a grant of the flood agent's ClusterProfile of about size
// bytes (its subject's groups), expiring at exp.
// floodMarker numbers the small grants that follow a flood's grants in a
// frame, apart from theirs.
const floodMarker = 1_000_000

func (a *floodAgent) floodGrant(i, size int, exp time.Time) *pb.Grant {
	var groups []string
	for n := 0; n < size; n += 24 {
		groups = append(groups, fmt.Sprintf("group-%016d", n))
	}
	return &pb.Grant{
		CredentialId:   fmt.Sprintf("JTI=%s-%06d", a.cluster, i),
		Cluster:        a.ref(),
		Subject:        &pb.Subject{Username: "system:serviceaccount:flood:x", Uid: "flood-uid", Groups: groups},
		ServiceAccount: &pb.ObjectReference{Namespace: "flood", Name: "x"},
		ExpirationTime: timestamppb.New(exp),
		Secret:         &pb.ObjectReference{Namespace: "flood", Name: fmt.Sprintf("grant-%d", i)},
	}
}

// heapMiB is the live heap of this process, which runs both brokers, after
// a full collection.
func heapMiB() float64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return float64(m.HeapAlloc) / (1 << 20)
}

// held returns the grants the first broker holds for the flood agent's
// ClusterProfile, and their size.
func (a *floodAgent) held() (n, size int) {
	for _, g := range deployment.Broker.Grants().Select(grants.Selector{Cluster: a.key()}) {
		n, size = n+1, size+proto.Size(g)
	}
	return n, size
}

// bystander exchanges, for another cluster, in a loop until stop is
// called, and returns the latencies; count tells how many it made.
func bystander(t *testing.T) (count func() int, stop func() (lat []time.Duration, failed int)) {
	t.Helper()
	cluster := env.Spokes[0]
	c := newConsumer(t, "credbroker", cluster.Name)
	optIn(t, cluster, "bystander", c.username())
	client := exchangeClient(t)
	_, err := exchangeVia(t, client, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster)})
	require.NoError(t, err)
	done := make(chan struct{})
	var (
		mu      sync.Mutex
		lats    []time.Duration
		errs    int
		stopped sync.WaitGroup
	)
	// A steady pace of 200 exchanges a second: each writes an audit line
	// into the suite's in-memory log, which would otherwise grow the heap
	// that the tests measure.
	tick := time.NewTicker(5 * time.Millisecond)
	stopped.Go(func() {
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			start := time.Now()
			_, err := exchangeVia(t, client, c, &pb.ExchangeRequest{Cluster: clusterRef(cluster)})
			mu.Lock()
			lats = append(lats, time.Since(start))
			if err != nil {
				errs++
			}
			mu.Unlock()
		}
	})
	count = func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(lats)
	}
	return count, func() ([]time.Duration, int) {
		close(done)
		stopped.Wait()
		return lats, errs
	}
}

func percentiles(lat []time.Duration) string {
	if len(lat) == 0 {
		return "no exchanges"
	}
	s := slices.Clone(lat)
	slices.Sort(s)
	p := func(q float64) time.Duration { return s[min(len(s)-1, int(q*float64(len(s))))] }
	return fmt.Sprintf("n=%d p50=%s p99=%s max=%s", len(s), p(0.50), p(0.99), s[len(s)-1])
}

// The attack: a compromised agent reports grants past every bound the
// broker sets on what an agent reports: grants of 56 KiB (thousands of
// groups), grants that expire in a century, and more grant bytes than one
// ClusterProfile may hold. A grant past a bound of its own is dropped and
// the rest of its frame taken, on a stream that stays open (drop the item,
// not the stream); a frame past the ClusterProfile's share is refused and
// the stream closed. The broker's heap does not grow with the flood, and
// another cluster's exchanges go on.
func TestAgentReportsAreBounded(t *testing.T) {
	// The bystander's latency alone, over 200 exchanges.
	count, stopBefore := bystander(t)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.GreaterOrEqual(c, count(), 200, "the bystander's exchanges") },
		30*time.Second, 10*time.Millisecond, "200 exchanges of the bystander")
	lat, failed := stopBefore()
	t.Logf("bystander exchanges before the flood: %s, failed %d", percentiles(lat), failed)

	_, stop := bystander(t)
	defer func() {
		lat, failed := stop()
		t.Logf("bystander exchanges during the flood: %s, failed %d", percentiles(lat), failed)
		assert.Zero(t, failed, "another cluster's exchanges failed during the flood")
	}()

	t.Run("grants larger than a grant may be", func(t *testing.T) {
		a := newFloodAgent(t, "flood-size")
		exp := time.Now().Add(30 * time.Minute)
		// Each frame: a grant of 56 KiB, and a small one, which the broker
		// takes.
		grant := func(i int) *pb.GrantUpdate {
			return &pb.GrantUpdate{Added: []*pb.Grant{a.floodGrant(i, 56<<10, exp), a.floodGrant(floodMarker+i, 0, exp)}}
		}
		// The first frames warm gRPC's buffer pools for messages this
		// large, which are no grant's.
		a.flood(t, 50, grant)
		before := heapMiB()
		closes := a.flood(t, 400, func(i int) *pb.GrantUpdate { return grant(50 + i) })
		n, size := a.held()
		after := heapMiB()
		t.Logf("400 grants of 56 KiB after 50: heap %.1f -> %.1f MiB (+%.1f), held %d grants of %d bytes, closes %v", before, after, after-before, n, size, closes)
		assert.Less(t, after-before, 16.0, "the broker's heap grew with the flood")
		assert.Equal(t, 450, n, "the broker holds grants larger than a grant may be, or dropped the rest of their frames")
		assert.Less(t, size, 450*1024, "the broker holds grants larger than a grant may be")
		assert.Zero(t, closes[codes.InvalidArgument], "the broker closed the stream for a grant it could drop")
		logLine(t, `"msg"="agent reported grants past a bound; dropped them and kept the rest of the report"`, `"cluster"="fleet/flood-size"`, `"bound"="grantBytes"`)
	})

	t.Run("grants that expire in a century", func(t *testing.T) {
		a := newFloodAgent(t, "flood-century")
		exp := time.Now().AddDate(100, 0, 0)
		closes := a.flood(t, 20, func(i int) *pb.GrantUpdate {
			u := &pb.GrantUpdate{}
			for j := range 200 {
				u.Added = append(u.Added, a.floodGrant(i*200+j, 0, exp))
			}
			u.Added = append(u.Added, a.floodGrant(floodMarker+i, 0, time.Now().Add(30*time.Minute)))
			return u
		})
		n, _ := a.held()
		t.Logf("20 frames of 200 grants expiring in a century and one that does not: held %d grants, closes %v", n, closes)
		assert.Equal(t, 20, n, "the broker holds grants that outlive any token it mints, or dropped the rest of their frames")
		assert.Zero(t, closes[codes.InvalidArgument], "the broker closed the stream for grants it could drop")
		logLine(t, `"msg"="agent reported grants past a bound; dropped them and kept the rest of the report"`, `"cluster"="fleet/flood-century"`, `"bound"="grantLifetime"`, `"dropped"=200`)
	})

	t.Run("more grant bytes than one ClusterProfile may hold", func(t *testing.T) {
		a := newFloodAgent(t, "flood-budget")
		exp := time.Now().Add(30 * time.Minute)
		// Fill the ClusterProfile's share, then go on: what comes after
		// the bound must not grow the heap.
		grant := func(i int) *pb.GrantUpdate {
			return &pb.GrantUpdate{Added: []*pb.Grant{a.floodGrant(i, 30<<10, exp)}}
		}
		first := a.flood(t, 1200, grant)
		// The heap is this whole test process's, where other work (an
		// earlier test's informers or triggers) may grow it meanwhile;
		// that only adds, so up to three floods are measured and the
		// least growth is judged: a broker that keeps what comes past the
		// bound grows by it in every round.
		var (
			before, after, grew float64
			n, size, sizeBefore int
			closes              map[codes.Code]int
		)
		for round := range 3 {
			before = heapMiB()
			_, sizeBefore = a.held()
			closes = a.flood(t, 1000, func(i int) *pb.GrantUpdate { return grant(1200 + 1000*round + i) })
			n, size = a.held()
			after = heapMiB()
			grew = after - before
			t.Logf("1,000 grants of 30 KiB past 1,200, round %d: heap %.1f -> %.1f MiB (+%.1f), held %d grants of %d bytes (%d before), closes %v then %v",
				round+1, before, after, grew, n, size, sizeBefore, first, closes)
			if grew < 16 {
				break
			}
		}
		assert.Less(t, grew, 16.0, "the broker's heap grew past the ClusterProfile's bound")
		assert.LessOrEqual(t, size, grants.DefaultMaxGrantBytesPerCluster)
		assert.Positive(t, closes[codes.ResourceExhausted], "the broker did not close the stream with ResourceExhausted")
		logLine(t, `"msg"="agent grant report refused; closing the stream"`, `"cluster"="fleet/flood-budget"`, `"bound"="clusterBytes"`)
	})

	t.Run("an agent version is clipped in the logs", func(t *testing.T) {
		a := newFloodAgent(t, "flood-version")
		long := "v1." + strings.Repeat("x", 32<<10)
		s, err := a.open(context.Background(), &pb.Hello{AgentVersion: long})
		require.NoError(t, err)
		defer s.close()
		line := logLine(t, `"msg"="agent connected"`, `"cluster"="fleet/flood-version"`, `v1.xxx`)
		assert.False(t, strings.Contains(line, strings.Repeat("x", 256)), "an agent's version reached the log unclipped: %d bytes", len(line))
		assert.Less(t, len(line), 4<<10)
	})
}

// hubRequests sums the hub API server's own count of requests for
// resource, apiserver_request_total{resource="<resource>"}.
func hubRequests(t *testing.T, resource string) float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	raw, err := env.Hub.Client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	require.NoError(t, err)
	var sum float64
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apiserver_request_total{") || !strings.Contains(line, `resource="`+resource+`"`) {
			continue
		}
		fields := strings.Fields(line)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		require.NoError(t, err, line)
		sum += v
	}
	require.NoError(t, sc.Err())
	return sum
}

// The attack: a hub ServiceAccount with no RBAC at all lists grants with an
// empty selector while nine ClusterProfiles hold other consumers' grants.
// Each call must cost at most one hub SubjectAccessReview, whatever others
// hold, and show the caller nothing of theirs; a bystander's exchanges go
// on meanwhile.
func TestGrantsListCostIsTheCallersOwn(t *testing.T) {
	ctx := context.Background()
	const profiles = 9
	exp := time.Now().Add(30 * time.Minute)
	for i := range profiles {
		a := newFloodAgent(t, fmt.Sprintf("amp-%d", i))
		s, err := a.open(ctx, &pb.Hello{AgentVersion: "amp", Grants: []*pb.Grant{a.floodGrant(i, 0, exp)}})
		require.NoError(t, err)
		t.Cleanup(s.close)
		require.EventuallyWithT(t, func(c *assert.CollectT) {
			n, _ := a.held()
			assert.Equal(c, 1, n, "the broker's grants of %s", a.cluster)
		}, 10*time.Second, 20*time.Millisecond, "the broker to take the grant of %s", a.cluster)
	}
	caller := newConsumer(t, "credbroker") // no RBAC
	client := grantsClient(t)

	count, stopBefore := bystander(t)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.GreaterOrEqual(c, count(), 200, "the bystander's exchanges") },
		30*time.Second, 10*time.Millisecond, "200 exchanges of the bystander")
	lat, _ := stopBefore()
	t.Logf("bystander exchanges before: %s", percentiles(lat))

	count, stop := bystander(t)
	require.EventuallyWithT(t, func(c *assert.CollectT) { assert.GreaterOrEqual(c, count(), 1, "the bystander's exchanges") },
		30*time.Second, 10*time.Millisecond, "the bystander's first exchange")
	before := hubRequests(t, "subjectaccessreviews")
	for range 10 {
		assert.Empty(t, listGrants(t, client, caller, nil), "a caller without RBAC sees others' grants")
	}
	reviews := hubRequests(t, "subjectaccessreviews") - before
	lat, failed := stop()
	t.Logf("10 List calls by a caller without RBAC, %d ClusterProfiles with others' grants: %.0f hub SubjectAccessReviews; bystander during: %s, failed %d",
		profiles, reviews, percentiles(lat), failed)
	assert.LessOrEqual(t, reviews, 10.0, "a caller's List cost depends on others' grants")
	assert.Zero(t, failed)
}
