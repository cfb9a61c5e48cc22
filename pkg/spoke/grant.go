package spoke

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net/url"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	corev1informers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/credbroker/credbroker/pkg/fleet"
)

// A grant is the Secret the agent creates for each token it mints, in the
// ServiceAccount's namespace. The token is bound to it (TokenRequest
// boundObjectRef), so deleting the grant revokes the token: the spoke API
// server refuses it once its authentication cache notices, about 10 s later.
// A grant holds no data; its labels and annotations say who the token is for.
const (
	// GrantType is the type of every grant Secret.
	GrantType corev1.SecretType = "credbroker.io/grant"
	// GrantLabel, set to "true", marks a grant for people and their tools
	// (kubectl get secrets -l credbroker.io/grant=true). The agent knows a
	// grant by its type, which cannot change, not by this label, which
	// others could drop; a grant without it is one someone else changed.
	GrantLabel = "credbroker.io/grant"
	// GrantServiceAccountLabel names the ServiceAccount the token is for,
	// when its name fits in a label value; GrantServiceAccountAnnotation
	// always does.
	GrantServiceAccountLabel = "credbroker.io/service-account"
	// GrantJTILabel is the token's jti claim, when it fits in a label value,
	// so that `kubectl get secrets -A -l credbroker.io/jti=<jti>` finds the
	// grant of a request in the spoke's audit log.
	GrantJTILabel = "credbroker.io/jti"
	// GrantServiceAccountAnnotation names the ServiceAccount the token is for.
	GrantServiceAccountAnnotation = "credbroker.io/service-account"
	// GrantHubUserAnnotation and GrantHubUIDAnnotation are the hub subject
	// the token was minted for.
	GrantHubUserAnnotation = "credbroker.io/hub-user"
	GrantHubUIDAnnotation  = "credbroker.io/hub-uid"
	// GrantClusterProfileAnnotation is the hub ClusterProfile
	// ("namespace/name") the broker admitted the agent for.
	GrantClusterProfileAnnotation = "credbroker.io/cluster-profile"
	// GrantAudiencesAnnotation lists the token's requested audiences,
	// comma-separated; empty for the API server's default audiences.
	GrantAudiencesAnnotation = "credbroker.io/audiences"
	// GrantExpirationAnnotation is when the token expires, in RFC 3339. Until
	// the mint completes it is the latest time the token can expire.
	GrantExpirationAnnotation = "credbroker.io/expiration"
	// GrantCredentialIDAnnotation is the token's credential id, "JTI=<jti>",
	// the value kube-apiserver writes into the audit log's
	// authentication.kubernetes.io/credential-id, and the broker's audit
	// line's credentialID.
	GrantCredentialIDAnnotation = "credbroker.io/credential-id"
	// GrantTokenSHA256Annotation is the SHA-256 of the token, in lowercase
	// hex, recorded with the credential id: the broker's API proxy forwards
	// a bearer only when its hash is that of a live grant's token.
	GrantTokenSHA256Annotation = "credbroker.io/token-sha256"
	// GrantHubGroupsAnnotation lists the hub subject's groups, as the hub's
	// TokenReview reported them, separated by commas; a comma or percent
	// sign inside a group is percent-encoded. A broker that restarts redoes
	// its SubjectAccessReview from them.
	GrantHubGroupsAnnotation = "credbroker.io/hub-groups"
	// GrantClusterProfileUIDAnnotation is the UID of the hub ClusterProfile
	// incarnation the broker admitted the agent for, so that the broker can
	// revoke the grants of a ClusterProfile that was deleted and recreated.
	GrantClusterProfileUIDAnnotation = "credbroker.io/cluster-profile-uid"

	grantGenerateName = "credbroker-grant-"
)

// GrantLabelSelector and GrantFieldSelector select grants, by label and by
// Secret type, in a List. The agent selects by type only: the label is
// what the agent writes, and someone else may remove it.
var (
	GrantLabelSelector = GrantLabel + "=true"
	GrantFieldSelector = fields.OneTermEqualSelector("type", string(GrantType)).String()
)

// GrantStore creates, annotates and deletes grant Secrets on the spoke,
// through the API server. The agent reads grants from an informer's cache
// (see NewGrantInformer), except the one lookup the cache cannot answer for
// sure. NewGrantStore adapts a clientset; tests use a fake.
type GrantStore interface {
	// Create creates grant in its namespace and returns it as stored.
	Create(ctx context.Context, grant *corev1.Secret) (*corev1.Secret, error)
	// Patch applies a JSON merge patch to a grant.
	Patch(ctx context.Context, namespace, name string, patch []byte) error
	// Delete deletes the grant namespace/name if its UID is still uid.
	Delete(ctx context.Context, namespace, name string, uid types.UID) error
	// ListCredential returns the grants that record credentialID, as the
	// API server has them now; it may return others too, which callers
	// skip. Revoke calls it for a credential id the cache does not know
	// (yet), so that a grant recorded a moment ago is not taken for gone.
	ListCredential(ctx context.Context, credentialID string) ([]corev1.Secret, error)
}

// NewGrantStore returns a GrantStore over client. It lists grants in
// namespace, or in every namespace when namespace is empty. The client's
// identity needs create, patch, delete and list on secrets; ListCredential
// asks only for Secrets of GrantType, so the agent never receives another
// Secret.
func NewGrantStore(client kubernetes.Interface, namespace string) GrantStore {
	return clientGrantStore{client: client, namespace: namespace}
}

type clientGrantStore struct {
	client    kubernetes.Interface
	namespace string
}

func (c clientGrantStore) Create(ctx context.Context, grant *corev1.Secret) (*corev1.Secret, error) {
	return c.client.CoreV1().Secrets(grant.Namespace).Create(ctx, grant, metav1.CreateOptions{})
}

func (c clientGrantStore) Patch(ctx context.Context, namespace, name string, patch []byte) error {
	_, err := c.client.CoreV1().Secrets(namespace).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

func (c clientGrantStore) Delete(ctx context.Context, namespace, name string, uid types.UID) error {
	return c.client.CoreV1().Secrets(namespace).Delete(ctx, name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
}

// ListCredential selects by GrantJTILabel when the jti fits in a label
// value; otherwise it lists every grant.
func (c clientGrantStore) ListCredential(ctx context.Context, credentialID string) ([]corev1.Secret, error) {
	selector := ""
	if jti, ok := strings.CutPrefix(credentialID, "JTI="); ok && jti != "" && len(validation.IsValidLabelValue(jti)) == 0 {
		selector = GrantJTILabel + "=" + jti
	}
	list, err := c.client.CoreV1().Secrets(c.namespace).List(ctx, metav1.ListOptions{
		LabelSelector: selector,
		FieldSelector: GrantFieldSelector,
	})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

// Indexes of the grant cache; NewGrantInformer adds them.
const (
	// GrantServiceAccountIndex indexes grants by the ServiceAccount
	// ("namespace/name") their token is for.
	GrantServiceAccountIndex = "credbroker.io/service-account"
	// GrantCredentialIDIndex indexes grants by their token's credential id.
	GrantCredentialIDIndex = "credbroker.io/credential-id"
)

// GrantIndexers returns the indexers the Minter needs on its grant cache.
func GrantIndexers() cache.Indexers {
	return cache.Indexers{
		cache.NamespaceIndex: cache.MetaNamespaceIndexFunc,
		GrantServiceAccountIndex: func(obj any) ([]string, error) {
			s, ok := obj.(*corev1.Secret)
			if !ok || s.Annotations[GrantServiceAccountAnnotation] == "" {
				return nil, nil
			}
			return []string{s.Namespace + "/" + s.Annotations[GrantServiceAccountAnnotation]}, nil
		},
		GrantCredentialIDIndex: func(obj any) ([]string, error) {
			s, ok := obj.(*corev1.Secret)
			if !ok || s.Annotations[GrantCredentialIDAnnotation] == "" {
				return nil, nil
			}
			return []string{s.Annotations[GrantCredentialIDAnnotation]}, nil
		},
	}
}

// NewGrantInformer returns an informer on the grants in namespace, or in
// every namespace when namespace is empty, with GrantIndexers. It lists and
// watches only Secrets of GrantType (a field selector), so the agent never
// receives another Secret; a Secret's type cannot change, so a grant
// leaves the informer only when it is deleted, whatever someone does to
// its labels. Its cache keeps no managed fields of them, and of any data
// only the keys, which the agent never writes: data in a grant shows that
// someone else changed it. The client's identity needs list and watch on
// secrets. Run it, and wait for it to sync, before the Minter's Run: until
// then every grant looks missing.
func NewGrantInformer(client kubernetes.Interface, namespace string) cache.SharedIndexInformer {
	inf := corev1informers.NewFilteredSecretInformer(client, namespace, 0, GrantIndexers(), func(o *metav1.ListOptions) {
		o.FieldSelector = GrantFieldSelector
	})
	// Set before the informer runs, so it cannot fail.
	_ = inf.SetTransform(func(obj any) (any, error) {
		if s, ok := obj.(*corev1.Secret); ok {
			s.ManagedFields = nil
			s.Data, s.StringData = dataKeys(s.Data), nil
		}
		return obj, nil
	})
	return inf
}

// dataKeys returns data's keys, without their values; nil for no data.
func dataKeys(data map[string][]byte) map[string][]byte {
	if len(data) == 0 {
		return nil
	}
	keys := make(map[string][]byte, len(data))
	for k := range data {
		keys[k] = nil
	}
	return keys
}

// grantInfo is what a grant records.
type grantInfo struct {
	serviceAccount *corev1.ServiceAccount
	hubUser        string
	hubUID         string
	hubGroups      []string
	clusterProfile string
	clusterUID     string
	audiences      []string
	expiration     time.Time
}

// profileName is how a grant records the ClusterProfile cluster:
// "namespace/name", or "" for none.
func profileName(cluster fleet.ClusterRef) string {
	if cluster.NamespacedName == (types.NamespacedName{}) {
		return ""
	}
	return cluster.String()
}

// newGrant returns the grant Secret to create for info.
func newGrant(info grantInfo) *corev1.Secret {
	g := newGrantOf(types.NamespacedName{Namespace: info.serviceAccount.Namespace, Name: info.serviceAccount.Name}, info.expiration)
	maps.Copy(g.Annotations, map[string]string{
		GrantHubUserAnnotation:           info.hubUser,
		GrantHubUIDAnnotation:            info.hubUID,
		GrantHubGroupsAnnotation:         joinGroups(info.hubGroups),
		GrantClusterProfileAnnotation:    info.clusterProfile,
		GrantClusterProfileUIDAnnotation: info.clusterUID,
		GrantAudiencesAnnotation:         strings.Join(info.audiences, ","),
	})
	return g
}

// newGrantOf returns a grant Secret to create for the ServiceAccount sa,
// expiring at exp, that names no owner: a pooled grant (pool.go), or the
// start of newGrant's.
func newGrantOf(sa types.NamespacedName, exp time.Time) *corev1.Secret {
	labels := map[string]string{GrantLabel: "true"}
	if len(validation.IsValidLabelValue(sa.Name)) == 0 {
		labels[GrantServiceAccountLabel] = sa.Name
	}
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Namespace:    sa.Namespace,
			GenerateName: grantGenerateName,
			Labels:       labels,
			Annotations: map[string]string{
				GrantServiceAccountAnnotation: sa.Name,
				GrantExpirationAnnotation:     exp.UTC().Format(time.RFC3339),
			},
		},
		Type: GrantType,
	}
}

// mintedPatch returns the merge patch that records a minted token's
// credential id, jti, hash and expiration on its grant.
func mintedPatch(credentialID string, tokenSHA256 [sha256.Size]byte, expiration time.Time) ([]byte, error) {
	labels := map[string]any{}
	if jti, ok := strings.CutPrefix(credentialID, "JTI="); ok && len(validation.IsValidLabelValue(jti)) == 0 {
		labels[GrantJTILabel] = jti
	}
	patch := map[string]any{"metadata": map[string]any{
		"labels": labels,
		"annotations": map[string]any{
			GrantCredentialIDAnnotation: credentialID,
			GrantTokenSHA256Annotation:  hex.EncodeToString(tokenSHA256[:]),
			GrantExpirationAnnotation:   expiration.UTC().Format(time.RFC3339),
		},
	}}
	b, err := json.Marshal(patch)
	if err != nil {
		return nil, fmt.Errorf("encode grant patch: %w", err)
	}
	return b, nil
}

// grantTokenSHA256 returns the token hash that grant records, or nil when
// it records none that is well formed.
func grantTokenSHA256(grant *corev1.Secret) []byte {
	b, err := hex.DecodeString(grant.Annotations[GrantTokenSHA256Annotation])
	if err != nil || len(b) != sha256.Size {
		return nil
	}
	return b
}

// maxLifetime is the longest lifetime of a token m mints.
func (m *Minter) maxLifetime() time.Duration { return time.Duration(m.maxSeconds) * time.Second }

// grantExpiration returns when grant's token expires: its
// GrantExpirationAnnotation or, when that is missing or garbled, its
// creation time plus maxLifetime, the longest a token of it can live.
func grantExpiration(grant *corev1.Secret, maxLifetime time.Duration) time.Time {
	if t, err := time.Parse(time.RFC3339, grant.Annotations[GrantExpirationAnnotation]); err == nil {
		return t
	}
	return grant.CreationTimestamp.Add(maxLifetime)
}

// expiration returns when the token of grant g expires, as g says, with
// the Minter's maximum lifetime for a grant that does not say.
func (m *Minter) expiration(g *corev1.Secret) time.Time {
	return grantExpiration(g, time.Duration(m.maxSeconds)*time.Second)
}

// groupEscaper percent-encodes the two characters that would make a
// comma-joined list of groups ambiguous.
var groupEscaper = strings.NewReplacer("%", "%25", ",", "%2C")

// joinGroups returns groups as GrantHubGroupsAnnotation records them.
func joinGroups(groups []string) string {
	escaped := make([]string, len(groups))
	for i, g := range groups {
		escaped[i] = groupEscaper.Replace(g)
	}
	return strings.Join(escaped, ",")
}

// splitGroups returns the groups a GrantHubGroupsAnnotation value records.
// An entry that is not validly encoded is dropped: a group the agent did
// not write is never reported.
func splitGroups(s string) []string {
	var groups []string
	for e := range strings.SplitSeq(s, ",") {
		if e == "" {
			continue
		}
		g, err := url.PathUnescape(e)
		if err != nil || joinGroups([]string{g}) != e {
			continue
		}
		groups = append(groups, g)
	}
	return groups
}
