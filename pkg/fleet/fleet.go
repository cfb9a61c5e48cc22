package fleet

import (
	"crypto/x509"
	"errors"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/types"
)

// ClusterRef names one incarnation of a ClusterProfile: a profile deleted and
// recreated under the same name has a new UID, and the sessions admitted for
// the old one do not serve the new one.
type ClusterRef struct {
	types.NamespacedName
	UID types.UID
}

func (c ClusterRef) String() string { return c.NamespacedName.String() }

// Cluster is what the exchange answers of a ClusterProfile, as the
// ClusterProfile index finds it.
type Cluster struct {
	// Ref names the ClusterProfile incarnation; its UID is part of the
	// exchange's token cache key.
	Ref ClusterRef
	// Server and CAData tell the consumer how to reach the spoke. Server
	// is never empty: the consumer's plugin hands the token only to it, so
	// a lookup refuses a ClusterProfile without one. CAData may be shared
	// with the informer's cache: read it, never modify it.
	Server string
	CAData []byte
}

// Admission is what a broker admitted an agent stream's peer as: the
// tunnel admits the peer, and the data path keeps its streams only while
// the tunnel admits the peer again (tunnel.Server's Admit and Readmit).
type Admission struct {
	// Agent is the peer's SPIFFE ID.
	Agent spiffeid.ID
	// Cluster is the one ClusterProfile incarnation the agent serves.
	Cluster ClusterRef
	// Expires is when the peer's SVID, or a CA of its chain, expires: the
	// stream must end then.
	Expires time.Time
	// Chain is the peer's certificate chain, leaf first, which a
	// readmission verifies again against the bundle of then.
	Chain []*x509.Certificate
}

// agentIDSegment is the first path segment of every ClusterProfile's
// default agent ID.
const agentIDSegment = "clusterprofile"

// AgentIDPathPrefix is the path under which every ClusterProfile's default
// agent ID lives: spiffe://<td>/clusterprofile/<namespace>/<name>.
const AgentIDPathPrefix = "/" + agentIDSegment + "/"

// AgentID returns the default SPIFFE ID of the agent that serves the
// ClusterProfile cluster: spiffe://<td>/clusterprofile/<namespace>/<name>.
// It fails when the namespace or the name is not a SPIFFE ID path segment.
func AgentID(td spiffeid.TrustDomain, cluster types.NamespacedName) (spiffeid.ID, error) {
	return spiffeid.FromSegments(td, agentIDSegment, cluster.Namespace, cluster.Name)
}

// BrokerID returns the broker's default SPIFFE ID, spiffe://<td>/broker.
func BrokerID(td spiffeid.TrustDomain) spiffeid.ID {
	return spiffeid.RequireFromPath(td, "/broker")
}

// ErrNoAgent is what the error of a request to a cluster's agents wraps
// when no agent stream of the cluster was open, so that nothing was sent.
var ErrNoAgent = errors.New("no agent is connected")

// MaxClockSkew is how far ahead of the broker's clock a spoke's clock may
// run: a token's exp, and the expiry of a grant an agent reports, may lie
// up to the broker's maximum expiration plus MaxClockSkew after the
// broker's now. One minute is the leeway JWT validators such as go-jose
// give by default.
const MaxClockSkew = time.Minute

// MaxGrantBytes bounds the grant an agent writes for a token, by the
// protobuf size of what it reports to the brokers before the token's
// credential id, hash and Secret name are known. It leaves room for those
// within the 32 KiB that an agent's grant reports carry, and that a broker
// holds, per grant. An agent refuses to mint a token whose grant would be
// larger, since no broker could list or revoke it.
const MaxGrantBytes = 30 << 10
