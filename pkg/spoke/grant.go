package spoke

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
)

// A grant is the Secret the agent creates for each token it mints, in the
// ServiceAccount's namespace. The token is bound to it (TokenRequest
// boundObjectRef), so deleting the grant revokes the token: the spoke API
// server refuses it once its authentication cache notices, about 10 s later.
// A grant holds no data; its labels and annotations say who the token is for.
const (
	// GrantType is the type of every grant Secret.
	GrantType corev1.SecretType = "credbroker.io/grant"
	// GrantLabel, set to "true", marks a grant.
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

	grantGenerateName = "credbroker-grant-"
)

// GrantLabelSelector and GrantFieldSelector select grants, by label and by
// Secret type, in a List.
var (
	GrantLabelSelector = GrantLabel + "=true"
	GrantFieldSelector = fields.OneTermEqualSelector("type", string(GrantType)).String()
)

// GrantStore creates, annotates, deletes and lists grant Secrets on the
// spoke. NewGrantStore adapts a clientset; tests use a fake.
type GrantStore interface {
	// Create creates grant in its namespace and returns it as stored.
	Create(ctx context.Context, grant *corev1.Secret) (*corev1.Secret, error)
	// Patch applies a JSON merge patch to a grant.
	Patch(ctx context.Context, namespace, name string, patch []byte) error
	// Delete deletes the grant namespace/name if its UID is still uid.
	Delete(ctx context.Context, namespace, name string, uid types.UID) error
	// List returns every grant the agent can see.
	List(ctx context.Context) ([]corev1.Secret, error)
	// ListServiceAccount returns the grants of the ServiceAccount
	// namespace/name; it may return others too, which callers skip.
	ListServiceAccount(ctx context.Context, namespace, name string) ([]corev1.Secret, error)
}

// NewGrantStore returns a GrantStore over client. It lists grants in
// namespace, or in every namespace when namespace is empty. The client's
// identity needs create, patch, delete and list on secrets; List asks only
// for Secrets of GrantType with GrantLabel, so the agent never receives
// another Secret.
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

func (c clientGrantStore) List(ctx context.Context) ([]corev1.Secret, error) {
	list, err := c.client.CoreV1().Secrets(c.namespace).List(ctx, metav1.ListOptions{
		LabelSelector: GrantLabelSelector,
		FieldSelector: GrantFieldSelector,
	})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

// ListServiceAccount selects by GrantServiceAccountLabel when name fits in
// a label value; otherwise it lists every grant in namespace.
func (c clientGrantStore) ListServiceAccount(ctx context.Context, namespace, name string) ([]corev1.Secret, error) {
	selector := GrantLabelSelector
	if len(validation.IsValidLabelValue(name)) == 0 {
		selector += "," + GrantServiceAccountLabel + "=" + name
	}
	list, err := c.client.CoreV1().Secrets(namespace).List(ctx, metav1.ListOptions{
		LabelSelector: selector,
		FieldSelector: GrantFieldSelector,
	})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

// grantInfo is what a grant records.
type grantInfo struct {
	serviceAccount *corev1.ServiceAccount
	hubUser        string
	hubUID         string
	clusterProfile string
	audiences      []string
	expiration     time.Time
}

// newGrant returns the grant Secret to create for info.
func newGrant(info grantInfo) *corev1.Secret {
	sa := info.serviceAccount
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
				GrantHubUserAnnotation:        info.hubUser,
				GrantHubUIDAnnotation:         info.hubUID,
				GrantClusterProfileAnnotation: info.clusterProfile,
				GrantAudiencesAnnotation:      strings.Join(info.audiences, ","),
				GrantExpirationAnnotation:     info.expiration.UTC().Format(time.RFC3339),
			},
		},
		Type: GrantType,
	}
}

// mintedPatch returns the merge patch that records a minted token's
// credential id, jti and expiration on its grant.
func mintedPatch(credentialID string, expiration time.Time) ([]byte, error) {
	labels := map[string]any{}
	if jti, ok := strings.CutPrefix(credentialID, "JTI="); ok && len(validation.IsValidLabelValue(jti)) == 0 {
		labels[GrantJTILabel] = jti
	}
	patch := map[string]any{"metadata": map[string]any{
		"labels": labels,
		"annotations": map[string]any{
			GrantCredentialIDAnnotation: credentialID,
			GrantExpirationAnnotation:   expiration.UTC().Format(time.RFC3339),
		},
	}}
	b, err := json.Marshal(patch)
	if err != nil {
		return nil, fmt.Errorf("encode grant patch: %w", err)
	}
	return b, nil
}

// grantExpiration returns when grant's token expires: its
// GrantExpirationAnnotation or, when that is missing or garbled, its
// creation time plus maxLifetime, the longest a token of it can live.
func grantExpiration(grant *corev1.Secret, maxLifetime time.Duration) time.Time {
	if t, err := time.Parse(time.RFC3339, grant.Annotations[GrantExpirationAnnotation]); err == nil {
		return t
	}
	return grant.CreationTimestamp.Add(maxLifetime)
}
