package clusterprofile

import (
	"errors"
	"fmt"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"

	"github.com/credbroker/credbroker/internal/serverurl"
	"github.com/credbroker/credbroker/pkg/errdefs"
	"github.com/credbroker/credbroker/pkg/fleet"
)

// Lookup answers the exchange's ClusterProfile lookups from an Index.
type Lookup struct {
	Index *Index
	// Provider is the access provider whose server is answered first
	// (Access's preferred).
	Provider string
}

// Cluster returns the ClusterProfile namespace/name as the exchange
// answers it. It fails as Get does for a missing profile, as CheckAgent
// does for one that no agent can serve, and with errdefs.ErrFailedPrecondition
// for one without a server or whose server is not a usable https URL. The
// answer's CAData is shared: read it, never modify it.
func (l Lookup) Cluster(namespace, name string) (fleet.Cluster, error) {
	key := types.NamespacedName{Namespace: namespace, Name: name}
	cp, err := l.Index.Shared(namespace, name) // read here, never kept
	if err != nil {
		l.Index.forgetFacts(key)
		return fleet.Cluster{}, err
	}
	f := l.Index.factsOf(key, cp, l.Provider)
	if err := l.Index.checkHolder(cp, f.agent, f.agentErr); err != nil {
		return fleet.Cluster{}, err
	}
	return f.cluster, f.accessErr
}

// profileFacts is what Lookup derives from one ClusterProfile object for
// one access provider: its agent ID and the answer's server and CA, or why
// there is none. They depend on the object alone, which the informer never
// modifies, so they are derived once per object, not once per exchange:
// they were ten allocations and 1.6 KB of every cached exchange.
type profileFacts struct {
	cp        *v1alpha1.ClusterProfile
	provider  string
	agent     spiffeid.ID
	agentErr  error
	cluster   fleet.Cluster
	accessErr error
}

// factsOf returns the facts of cp, the current object of key, for
// provider: those derived before if they were derived from this very
// object, or new ones, kept for the next call.
func (i *Index) factsOf(key types.NamespacedName, cp *v1alpha1.ClusterProfile, provider string) *profileFacts {
	i.factsMu.RLock()
	f := i.facts[key]
	i.factsMu.RUnlock()
	if f != nil && f.cp == cp && f.provider == provider {
		return f
	}
	f = &profileFacts{cp: cp, provider: provider}
	f.agent, f.agentErr = agentIDFault(agentID(i.td, cp))
	f.cluster, f.accessErr = access(cp, provider)
	i.factsMu.Lock()
	defer i.factsMu.Unlock()
	// Keep them only while cp is still the informer's object: once the
	// informer has replaced or deleted it (and dropped its facts),
	// keeping them would keep cp alive, for good if the name is gone.
	if obj, exists, err := i.indexer.GetByKey(key.String()); err == nil && exists && obj == any(cp) {
		i.facts[key] = f
	}
	return f
}

// forgetFacts drops the facts of key, a ClusterProfile that is gone.
func (i *Index) forgetFacts(key types.NamespacedName) {
	i.factsMu.RLock()
	_, ok := i.facts[key]
	i.factsMu.RUnlock()
	if !ok {
		return // as for every lookup of a name that never existed
	}
	i.factsMu.Lock()
	delete(i.facts, key)
	i.factsMu.Unlock()
}

// access is the answer of cp for provider: its incarnation, server and CA
// (Access, not copied), or an error wrapping errdefs.ErrFailedPrecondition
// when it has no server or an unusable one.
func access(cp *v1alpha1.ClusterProfile, provider string) (fleet.Cluster, error) {
	namespace, name := cp.Namespace, cp.Name
	server, ca, ok := accessOf(cp, provider)
	if !ok {
		// Never answer an empty server: the plugin checks that the token
		// goes to this cluster's server, and could not check against none.
		return fleet.Cluster{}, fmt.Errorf("ClusterProfile %s/%s has no server: neither its access provider %q nor any other "+
			"in its status has a cluster.server; its cluster manager must set status.accessProviders[name=%s].cluster.server: %w",
			namespace, name, provider, provider, errdefs.ErrFailedPrecondition)
	}
	if err := checkHTTPS(namespace, name, provider, server); err != nil {
		return fleet.Cluster{}, err
	}
	return fleet.Cluster{
		Ref:    fleet.ClusterRef{NamespacedName: types.NamespacedName{Namespace: namespace, Name: name}, UID: cp.UID},
		Server: server,
		CAData: ca,
	}, nil
}

// checkHTTPS refuses a ClusterProfile server that serverurl.Check refuses,
// the rule the publisher pins an entry by: client-go sends the bearer token
// whatever the scheme, so to an http server the token would travel in
// cleartext, and an API server URL has a host and no user information,
// query or fragment. The error, wrapping errdefs.ErrFailedPrecondition,
// names the ClusterProfile, the server (without a password), why it is
// refused and the access provider to fix.
func checkHTTPS(namespace, name, provider, server string) error {
	err := serverurl.Check(server)
	if err == nil {
		return nil
	}
	why := "which is not an https URL, so a token sent there would travel in cleartext"
	if !errors.Is(err, serverurl.ErrNotHTTPS) {
		why = fmt.Sprintf("which is not a usable API server URL (%v)", err)
	}
	return fmt.Errorf("ClusterProfile %s/%s has the server %q, %s: its cluster manager must set "+
		"status.accessProviders[name=%s].cluster.server to the spoke API server's https URL, with a host and without "+
		"user information, query or fragment: %w", namespace, name, serverurl.Redacted(server), why, provider,
		errdefs.ErrFailedPrecondition)
}
