package faults

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/credbroker/credbroker/proto/credbroker/v1alpha1"
	"github.com/credbroker/credbroker/test/framework"
)

// bomberEnv, when set, makes the test binary a bomber (see runBomber)
// instead of running the tests: the bombs come from another process, so
// that the test's own allocations of them are not counted as the broker's.
const bomberEnv = "CREDBROKER_FAULTS_BOMBER"

// bomberConfig is what the bomber process is told, as JSON in bomberEnv.
type bomberConfig struct {
	Case         string
	Times        int
	Size         int
	ExchangeAddr string
	AgentAddr    string
	CAFile       string
	Token        string
	// SVIDCert and SVIDKey are an agent's SVID, for the agent port.
	SVIDCert, SVIDKey string
}

// bombSize is the size of one bomb, and bombs how many of each are sent:
// together far more than anything the broker may keep.
const (
	bombSize = 4 << 20
	bombs    = 8
)

// TestBombsAreRefusedWithoutBeingAllocated sends the broker, from another
// process, metadata bombs and messages over its limits on both gRPC ports,
// each bombs times: a 4 MiB authorization header and 20,000 small headers
// (over the broker's 64 KiB header list limit), a 4 MiB ExchangeRequest (over the
// 64 KiB message limit), and from an agent with a valid SVID a 4 MiB hello
// and a 4 MiB frame after an admitted hello. Each is refused with the code
// gRPC gives; the broker allocates a small part of what was sent (what the
// test process allocated, beyond what it allocates while a bomber that
// sends nothing runs, is under a quarter of the bombs), keeps none of it,
// and serves an exchange after each.
func TestBombsAreRefusedWithoutBeingAllocated(t *testing.T) {
	c := newCaller(t, 1, spoke1)
	waitFor(t, 30*time.Second, "the agents", func(c assert.TestingT) { assertConnected(c, spoke1, 2); assertConnected(c, spoke2, 1) })
	svidCert, svidKey, err := deployment.CA.WriteSVIDFor(t.TempDir(), framework.AgentID(spoke2.Name), time.Hour)
	require.NoError(t, err)

	cases := []struct {
		name string
		// want starts what the bomber saw, every time.
		want string
	}{
		// The server's hpack decoder refuses a string longer than the header
		// list limit from its length prefix, and closes the connection.
		{"exchange: raw 4 MiB authorization header", "connection closed by the server"},
		// Decoding stops at the limit: the stream is reset, and the
		// connection closed at the next CONTINUATION frame.
		{"exchange: raw 20000 headers", "connection closed by the server"},
		// A gRPC client checks the server's SETTINGS_MAX_HEADER_LIST_SIZE
		// and sends nothing.
		{"exchange: grpc 4 MiB authorization header", "Internal: header list size to send violates the maximum size (65536 bytes) set by server"},
		{"exchange: grpc 4 MiB ExchangeRequest", "ResourceExhausted: grpc: received message larger than max ("},
		{"agent: raw 4 MiB header", "connection closed by the server"},
		{"agent: grpc 4 MiB hello", "ResourceExhausted: grpc: received message larger than max ("},
		{"agent: grpc 4 MiB frame after the hello", "ResourceExhausted: grpc: received message larger than max ("},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := bomberConfig{
				Case: tc.name, Times: bombs, Size: bombSize,
				ExchangeAddr: deployment.Broker.ExchangeAddr(), AgentAddr: deployment.Broker.AgentAddr(),
				CAFile: deployment.CAFile, Token: c.Token, SVIDCert: svidCert, SVIDKey: svidKey,
			}
			// A bomber that sends nothing measures what this process
			// allocates meanwhile on its own (informers, agents, timers),
			// which the machine's load stretches. Work of its own that
			// starts during the bombs (such as the brokers' revocation
			// triggers after another test's RBAC changes) only adds, so
			// up to three rounds are measured and the least is judged: a
			// broker that allocates the bombs does so in every round.
			var (
				allocated, kept int64
				seen            []string
			)
			for round := range 3 {
				idle := cfg
				idle.Times = 0
				idleBefore, idleAfter, _ := bombFromAnotherProcess(t, idle)
				background := int64(idleAfter.TotalAlloc - idleBefore.TotalAlloc)
				var before, after runtime.MemStats
				before, after, seen = bombFromAnotherProcess(t, cfg)
				allocated = int64(after.TotalAlloc-before.TotalAlloc) - background
				kept = int64(after.HeapAlloc) - int64(before.HeapAlloc)
				require.Len(t, seen, bombs)
				t.Logf("%s ×%d, round %d: %q; the test process allocated %s meanwhile beyond the %s of an idle bomber (the bombs: %s), heap %s → %s",
					tc.name, bombs, round+1, seen[0], mib(allocated), mib(background), mib(bombs*bombSize), mib(int64(before.HeapAlloc)), mib(int64(after.HeapAlloc)))
				if allocated < int64(bombs*bombSize/4) && kept < int64(bombs*bombSize/8) {
					break
				}
			}
			for _, s := range seen {
				require.True(t, strings.HasPrefix(s, tc.want), "got %q, want %q…", s, tc.want)
			}
			require.Less(t, allocated, int64(bombs*bombSize/4), "the broker must not allocate the bombs whole")
			require.Less(t, kept, int64(bombs*bombSize/8), "the broker must keep nothing of the bombs")

			_, _, err := c.exchange(spoke1, 0, mintTimeout)
			require.NoError(t, err, "the broker serves on")
			waitFor(t, 10*time.Second, "the bomber's agent streams to end", func(c assert.TestingT) { assertConnected(c, spoke2, 1) })
		})
	}
	requireNoPendingMints(t)
}

// bombFromAnotherProcess runs the bomber in a child process and returns
// the test process's memory statistics, after a GC, before and after it, and
// what the bomber saw each time.
func bombFromAnotherProcess(t *testing.T, cfg bomberConfig) (before, after runtime.MemStats, seen []string) {
	t.Helper()
	raw, err := json.Marshal(cfg)
	require.NoError(t, err)
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), bomberEnv+"="+string(raw))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// Starting a child allocates next to nothing in this process.
	runtime.GC()
	runtime.ReadMemStats(&before)
	err = cmd.Run()
	runtime.GC()
	runtime.ReadMemStats(&after)
	require.NoError(t, err, "bomber: %s", stderr.String())
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &seen), "bomber: %s", stdout.String())
	return before, after, seen
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// runBomber is the child process: it sends cfg's bomb cfg.Times times and
// prints, as a JSON list, what it saw each time.
func runBomber(raw string) int {
	var cfg bomberConfig
	if err := json.Unmarshal([]byte(raw), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	seen, err := bomb(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	out, _ := json.Marshal(seen)
	fmt.Println(string(out))
	return 0
}

func bomb(cfg bomberConfig) ([]string, error) {
	pemBytes, err := os.ReadFile(cfg.CAFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pemBytes)
	exchangeTLS := &tls.Config{RootCAs: pool, ServerName: "localhost", MinVersion: tls.VersionTLS12}
	svid, err := tls.LoadX509KeyPair(cfg.SVIDCert, cfg.SVIDKey)
	if err != nil {
		return nil, err
	}
	// The attacker has an agent's SVID; it does not care who the broker is.
	agentTLS := &tls.Config{Certificates: []tls.Certificate{svid}, InsecureSkipVerify: true, MinVersion: tls.VersionTLS12} //nolint:gosec // the attacker's client
	big := strings.Repeat("A", cfg.Size)
	auth := []hpack.HeaderField{{Name: "authorization", Value: "Bearer " + big}}
	var many []hpack.HeaderField
	for i := range 20000 {
		many = append(many, hpack.HeaderField{Name: fmt.Sprintf("x-bomb-%05d", i), Value: "v"})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	var once func() (string, error)
	switch cfg.Case {
	case "exchange: raw 4 MiB authorization header":
		once = func() (string, error) {
			return rawHeaders(ctx, cfg.ExchangeAddr, exchangeTLS, pb.TokenExchange_Exchange_FullMethodName, auth)
		}
	case "exchange: raw 20000 headers":
		once = func() (string, error) {
			return rawHeaders(ctx, cfg.ExchangeAddr, exchangeTLS, pb.TokenExchange_Exchange_FullMethodName, many)
		}
	case "agent: raw 4 MiB header":
		once = func() (string, error) {
			return rawHeaders(ctx, cfg.AgentAddr, agentTLS, pb.AgentTunnel_Connect_FullMethodName, auth)
		}
	case "exchange: grpc 4 MiB authorization header", "exchange: grpc 4 MiB ExchangeRequest":
		once = func() (string, error) {
			conn, err := grpc.NewClient(cfg.ExchangeAddr, grpc.WithTransportCredentials(credentials.NewTLS(exchangeTLS)))
			if err != nil {
				return "", err
			}
			defer conn.Close()
			req := &pb.ExchangeRequest{Cluster: &pb.ObjectReference{Namespace: framework.FleetNamespace, Name: "spoke-1"}}
			md := metadata.Pairs("authorization", "Bearer "+cfg.Token)
			if strings.Contains(cfg.Case, "header") {
				md = metadata.Pairs("authorization", "Bearer "+big)
			} else {
				req.Audiences = []string{big}
			}
			_, err = pb.NewTokenExchangeClient(conn).Exchange(metadata.NewOutgoingContext(ctx, md), req)
			return codeAndMessage(err), nil
		}
	case "agent: grpc 4 MiB hello", "agent: grpc 4 MiB frame after the hello":
		once = func() (string, error) {
			conn, err := grpc.NewClient(cfg.AgentAddr, grpc.WithTransportCredentials(credentials.NewTLS(agentTLS)))
			if err != nil {
				return "", err
			}
			defer conn.Close()
			sctx, cancel := context.WithCancel(ctx)
			defer cancel()
			stream, err := pb.NewAgentTunnelClient(conn).Connect(sctx)
			if err != nil {
				return "", err
			}
			oversized := &pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{Server: big}}}
			if strings.Contains(cfg.Case, "after the hello") {
				if err := stream.Send(&pb.AgentFrame{Body: &pb.AgentFrame_Hello{Hello: &pb.Hello{}}}); err != nil {
					return "", err
				}
				if _, err := stream.Header(); err != nil {
					return "", fmt.Errorf("the hello was not admitted: %w", err)
				}
				oversized = &pb.AgentFrame{Body: &pb.AgentFrame_GrantUpdate{GrantUpdate: &pb.GrantUpdate{Removed: []string{big[:cfg.Size-2]}}}}
			}
			// The broker may end the stream before the whole frame is sent:
			// Recv has its status.
			_ = stream.Send(oversized)
			for {
				if _, err := stream.Recv(); err != nil {
					return codeAndMessage(err), nil
				}
			}
		}
	default:
		return nil, fmt.Errorf("no bomb %q", cfg.Case)
	}
	var seen []string
	for range cfg.Times {
		s, err := once()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", cfg.Case, err)
		}
		seen = append(seen, s)
	}
	return seen, nil
}

func codeAndMessage(err error) string {
	st := status.Convert(err)
	return st.Code().String() + ": " + st.Message()
}

// rawHeaders opens an HTTP/2 connection as a gRPC client would, without a
// gRPC client's checks, sends a request with extra headers in HEADERS and
// CONTINUATION frames of 16 KiB, and returns how the server answered.
func rawHeaders(ctx context.Context, addr string, cfg *tls.Config, path string, extra []hpack.HeaderField) (string, error) {
	cfg = cfg.Clone()
	cfg.NextProtos = []string{"h2"}
	d := tls.Dialer{Config: cfg}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	for _, hf := range append([]hpack.HeaderField{
		{Name: ":method", Value: "POST"}, {Name: ":scheme", Value: "https"}, {Name: ":path", Value: path},
		{Name: ":authority", Value: "localhost"}, {Name: "content-type", Value: "application/grpc"}, {Name: "te", Value: "trailers"},
	}, extra...) {
		if err := enc.WriteField(hf); err != nil {
			return "", err
		}
	}
	fr := http2.NewFramer(c, c)
	// Write from another goroutine: the server may close the connection
	// before it has read everything, and its last frames must be read.
	go func() {
		if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
			return
		}
		if fr.WriteSettings() != nil {
			return
		}
		const frame = 16 << 10
		b := block.Bytes()
		n := min(len(b), frame)
		if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: b[:n], EndHeaders: n == len(b)}) != nil {
			return
		}
		for b = b[n:]; len(b) > 0; b = b[n:] {
			n = min(len(b), frame)
			if fr.WriteContinuation(1, n == len(b), b[:n]) != nil {
				return
			}
		}
	}()
	var got []string
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			if errors.Is(err, io.EOF) || strings.Contains(err.Error(), "connection reset") {
				return strings.Join(append(got, "connection closed by the server"), ", "), nil
			}
			return "", fmt.Errorf("after %v: %w", got, err)
		}
		// The server's SETTINGS go unacknowledged: only the writer
		// goroutine writes.
		switch f := f.(type) {
		case *http2.GoAwayFrame:
			got = append(got, "GOAWAY "+f.ErrCode.String())
		case *http2.RSTStreamFrame:
			got = append(got, "RST_STREAM "+f.ErrCode.String())
		case *http2.HeadersFrame:
			got = append(got, "HEADERS")
			if f.StreamEnded() {
				return strings.Join(got, ", "), nil
			}
		}
	}
}
