package framework

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensions "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	clientcmdv1 "k8s.io/client-go/tools/clientcmd/api/v1"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	inventory "sigs.k8s.io/cluster-inventory-api/client/clientset/versioned"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

const (
	// ExecExtensionName is the name of the cluster extension that carries an
	// exec plugin's configuration in a ClusterProfile access provider.
	ExecExtensionName = "client.authentication.k8s.io/exec"

	// ClusterManagerName is the cluster manager that CreateClusterProfile
	// writes into spec.clusterManager and the x-k8s.io/cluster-manager label.
	ClusterManagerName = "credbroker-framework"

	// grantPrefix starts the names of the Roles, ClusterRoles and bindings
	// that Grant creates.
	grantPrefix = "credbroker-framework-"
)

// Cluster is one running kube-apiserver with its etcd. Every field is set by
// Start and read-only afterwards.
type Cluster struct {
	// Name is "hub", "spoke-1", "spoke-2", ….
	Name string
	// Config is an admin (system:masters) client-certificate config with
	// QPS and Burst raised for tests. Copy it before changing it.
	Config *rest.Config
	// Client is a clientset for Config.
	Client kubernetes.Interface
	// Server is the https URL of the API server, without a trailing slash.
	Server string
	// CAData is the PEM CA that verifies Server.
	CAData []byte
	// Issuer is the service account issuer of this cluster; it is also the
	// default audience of its tokens.
	Issuer string
	// Inventory is a cluster-inventory-api clientset; set on the hub only.
	Inventory inventory.Interface
	// AuditLog is the API server's audit log (JSON lines, Metadata level,
	// watches left out); AuditEvents reads it.
	AuditLog string

	mu       sync.Mutex
	cp       *envtest.ControlPlane
	auditDir string
	admin    *envtest.AuthenticatedUser
	output   *tailBuffer
}

// Stop stops the cluster's kube-apiserver and etcd and removes their
// temporary files. It is safe to call more than once, and on a nil Cluster.
func (c *Cluster) Stop() error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cp == nil {
		return nil
	}
	cp := c.cp
	c.cp = nil
	err := cp.Stop()
	if rmErr := os.RemoveAll(c.auditDir); rmErr != nil {
		err = errors.Join(err, rmErr)
	}
	if err != nil {
		return fmt.Errorf("framework: stop %s: %w", c.Name, err)
	}
	return nil
}

// AuditEvent is what a test reads of one event of the audit log.
type AuditEvent struct {
	AuditID    string `json:"auditID"`
	Verb       string `json:"verb"`
	RequestURI string `json:"requestURI"`
	User       struct {
		Username string              `json:"username"`
		Extra    map[string][]string `json:"extra"`
	} `json:"user"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	// ObjectRef is what a resource request was about; nil for a
	// non-resource URL such as /openid/v1/jwks.
	ObjectRef *AuditObjectRef `json:"objectRef"`
}

// AuditObjectRef is the object of an audited resource request.
type AuditObjectRef struct {
	APIGroup    string `json:"apiGroup"`
	Resource    string `json:"resource"`
	Subresource string `json:"subresource"`
	Namespace   string `json:"namespace"`
	Name        string `json:"name"`
}

// CredentialIDExtra is the user extra in which kube-apiserver records the
// credential id of a request's token, "JTI=<jti>" for a ServiceAccount token.
const CredentialIDExtra = "authentication.kubernetes.io/credential-id"

// AuditEvents returns the events of the audit log that match, in the order
// the API server wrote them.
func (c *Cluster) AuditEvents(match func(AuditEvent) bool) ([]AuditEvent, error) {
	f, err := os.Open(c.AuditLog)
	if err != nil {
		return nil, fmt.Errorf("framework: %s: audit log: %w", c.Name, err)
	}
	defer f.Close()
	var out []AuditEvent
	dec := json.NewDecoder(f)
	for {
		var ev AuditEvent
		if err := dec.Decode(&ev); errors.Is(err, io.EOF) {
			return out, nil
		} else if err != nil {
			return out, fmt.Errorf("framework: %s: audit log: %w", c.Name, err)
		}
		if match(ev) {
			out = append(out, ev)
		}
	}
}

// Kubeconfig returns an admin kubeconfig for the cluster, for tools and
// child processes.
func (c *Cluster) Kubeconfig() ([]byte, error) {
	if c.admin == nil {
		return nil, fmt.Errorf("framework: %s is not running", c.Name)
	}
	return c.admin.KubeConfig()
}

// WriteKubeconfig writes the admin kubeconfig to a file named after the
// cluster in dir and returns its path.
func (c *Cluster) WriteKubeconfig(dir string) (string, error) {
	data, err := c.Kubeconfig()
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, c.Name+".kubeconfig")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return "", fmt.Errorf("framework: write kubeconfig: %w", err)
	}
	return path, nil
}

// TokenConfig returns a config that authenticates to the cluster with the
// bearer token and nothing else.
func (c *Cluster) TokenConfig(token string) *rest.Config {
	cfg := rest.AnonymousClientConfig(c.Config)
	cfg.BearerToken = token
	return cfg
}

// Output returns the last few KiB that the cluster's etcd and kube-apiserver
// wrote, for debugging a failed test.
func (c *Cluster) Output() string {
	if c.output == nil {
		return ""
	}
	c.output.mu.Lock()
	defer c.output.mu.Unlock()
	return string(c.output.buf)
}

// Access returns an Access that points at this cluster, for a ClusterProfile
// on the hub.
func (c *Cluster) Access(providerName string, execConfig []byte) *Access {
	return &Access{ProviderName: providerName, Server: c.Server, CAData: c.CAData, ExecConfig: execConfig}
}

// EnsureNamespace creates the namespace unless it exists.
func (c *Cluster) EnsureNamespace(ctx context.Context, name string) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("framework: %s: create namespace %s: %w", c.Name, name, err)
	}
	return nil
}

// CreateServiceAccount creates the namespace if needed and then the service
// account. It fails if the service account exists.
func (c *Cluster) CreateServiceAccount(ctx context.Context, namespace, name string, annotations map[string]string) (*corev1.ServiceAccount, error) {
	if err := c.EnsureNamespace(ctx, namespace); err != nil {
		return nil, err
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, Annotations: annotations}}
	sa, err := c.Client.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("framework: %s: create serviceaccount %s/%s: %w", c.Name, namespace, name, err)
	}
	return sa, nil
}

// Token mints a token for the service account with the TokenRequest API.
// Empty audiences means the API server's default (the cluster's Issuer);
// ttl 0 means the API server's default (1h). The API server refuses a ttl
// under 10 minutes.
func (c *Cluster) Token(ctx context.Context, namespace, name string, audiences []string, ttl time.Duration) (string, error) {
	tr := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{Audiences: audiences}}
	if ttl > 0 {
		secs := int64(ttl / time.Second)
		tr.Spec.ExpirationSeconds = &secs
	}
	tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, tr, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("framework: %s: token for serviceaccount %s/%s: %w", c.Name, namespace, name, err)
	}
	return tr.Status.Token, nil
}

// ReviewToken asks the cluster to authenticate token with a TokenReview.
// Empty audiences means the API server's default audiences.
func (c *Cluster) ReviewToken(ctx context.Context, token string, audiences []string) (*authenticationv1.TokenReviewStatus, error) {
	tr := &authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: token, Audiences: audiences}}
	tr, err := c.Client.AuthenticationV1().TokenReviews().Create(ctx, tr, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("framework: %s: token review: %w", c.Name, err)
	}
	return &tr.Status, nil
}

// ServiceAccountSubject returns the RBAC subject of a service account.
func ServiceAccountSubject(namespace, name string) rbacv1.Subject {
	return rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Namespace: namespace, Name: name}
}

// ServiceAccountUser returns the user name and groups that a service
// account's token authenticates as.
func ServiceAccountUser(namespace, name string) (string, []string) {
	return "system:serviceaccount:" + namespace + ":" + name,
		[]string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"}
}

// ClusterProfileTokenRule is the rule that lets a subject create the token
// subresource of the named ClusterProfiles.
func ClusterProfileTokenRule(clusterProfiles ...string) rbacv1.PolicyRule {
	return rbacv1.PolicyRule{
		APIGroups:     []string{v1alpha1.GroupVersion.Group},
		Resources:     []string{"clusterprofiles/token"},
		Verbs:         []string{"create"},
		ResourceNames: clusterProfiles,
	}
}

// GrantClusterProfileToken lets the service account saNamespace/saName
// create multicluster.x-k8s.io clusterprofiles/token for the ClusterProfile
// named clusterProfile in namespace, with a Role and RoleBinding.
func (c *Cluster) GrantClusterProfileToken(ctx context.Context, namespace, clusterProfile, saNamespace, saName string) error {
	return c.Grant(ctx, namespace, ServiceAccountSubject(saNamespace, saName),
		[]rbacv1.PolicyRule{ClusterProfileTokenRule(clusterProfile)})
}

// Grant gives subject the rules: in namespace with a Role and RoleBinding,
// or cluster-wide with a ClusterRole and ClusterRoleBinding when namespace
// is "". The objects are named after a hash of the arguments, so granting
// the same thing twice is a no-op. A ServiceAccount subject needs Namespace;
// User and Group subjects get the RBAC API group filled in.
//
// Grant returns once the API server's authorizer allows the first rule for
// subject, so a SubjectAccessReview right after it sees the grant.
func (c *Cluster) Grant(ctx context.Context, namespace string, subject rbacv1.Subject, rules []rbacv1.PolicyRule) error {
	if len(rules) == 0 {
		return fmt.Errorf("framework: %s: grant: no rules", c.Name)
	}
	if subject.Name == "" {
		return fmt.Errorf("framework: %s: grant: subject has no name", c.Name)
	}
	if (subject.Kind == rbacv1.UserKind || subject.Kind == rbacv1.GroupKind) && subject.APIGroup == "" {
		subject.APIGroup = rbacv1.GroupName
	}
	if namespace != "" {
		if err := c.EnsureNamespace(ctx, namespace); err != nil {
			return err
		}
	}
	name, err := grantName(namespace, subject, rules)
	if err != nil {
		return fmt.Errorf("framework: %s: grant: %w", c.Name, err)
	}
	meta := metav1.ObjectMeta{Name: name, Namespace: namespace}
	subjects := []rbacv1.Subject{subject}
	rbac := c.Client.RbacV1()
	if namespace == "" {
		_, err = rbac.ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: meta, Rules: rules}, metav1.CreateOptions{})
		if err == nil || apierrors.IsAlreadyExists(err) {
			_, err = rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
				ObjectMeta: meta,
				RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
				Subjects:   subjects,
			}, metav1.CreateOptions{})
		}
	} else {
		_, err = rbac.Roles(namespace).Create(ctx, &rbacv1.Role{ObjectMeta: meta, Rules: rules}, metav1.CreateOptions{})
		if err == nil || apierrors.IsAlreadyExists(err) {
			_, err = rbac.RoleBindings(namespace).Create(ctx, &rbacv1.RoleBinding{
				ObjectMeta: meta,
				RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name},
				Subjects:   subjects,
			}, metav1.CreateOptions{})
		}
	}
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("framework: %s: grant %s to %s %s: %w", c.Name, name, subject.Kind, subject.Name, err)
	}
	return c.waitForGrant(ctx, namespace, subject, rules[0])
}

// waitForGrant polls a SubjectAccessReview for the first verb, group,
// resource and name of rule until the RBAC authorizer, which works from an
// informer cache, allows it.
func (c *Cluster) waitForGrant(ctx context.Context, namespace string, subject rbacv1.Subject, rule rbacv1.PolicyRule) error {
	first := func(s []string) string {
		if len(s) == 0 {
			return ""
		}
		return s[0]
	}
	spec := authorizationv1.SubjectAccessReviewSpec{}
	var ok bool
	if spec.User, spec.Groups, ok = subjectUser(subject); !ok {
		return nil // the API server validated the binding; nothing to probe with
	}
	if len(rule.NonResourceURLs) > 0 {
		spec.NonResourceAttributes = &authorizationv1.NonResourceAttributes{Path: first(rule.NonResourceURLs), Verb: first(rule.Verbs)}
	} else {
		resource, sub, _ := strings.Cut(first(rule.Resources), "/")
		spec.ResourceAttributes = &authorizationv1.ResourceAttributes{
			Namespace: namespace, Verb: first(rule.Verbs), Group: first(rule.APIGroups),
			Resource: resource, Subresource: sub, Name: first(rule.ResourceNames),
		}
	}
	var last *authorizationv1.SubjectAccessReviewStatus
	err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		sar, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx,
			&authorizationv1.SubjectAccessReview{Spec: spec}, metav1.CreateOptions{})
		if err != nil {
			return false, err
		}
		last = &sar.Status
		return sar.Status.Allowed, nil
	})
	if err != nil {
		return fmt.Errorf("framework: %s: wait for grant to %s %s to take effect (last review: %+v): %w",
			c.Name, subject.Kind, subject.Name, last, err)
	}
	return nil
}

// subjectUser is the user and groups that a SubjectAccessReview for an RBAC
// subject asks about; ok is false for an unknown kind.
func subjectUser(subject rbacv1.Subject) (user string, groups []string, ok bool) {
	switch subject.Kind {
	case rbacv1.ServiceAccountKind:
		user, groups = ServiceAccountUser(subject.Namespace, subject.Name)
		return user, groups, true
	case rbacv1.UserKind:
		return subject.Name, nil, true
	case rbacv1.GroupKind:
		return grantPrefix + "probe", []string{subject.Name}, true
	}
	return "", nil, false
}

// Allowed asks the cluster with a SubjectAccessReview whether subject (a
// ServiceAccount, User or Group) may do what attrs describes.
func (c *Cluster) Allowed(ctx context.Context, subject rbacv1.Subject, attrs authorizationv1.ResourceAttributes) (bool, error) {
	spec := authorizationv1.SubjectAccessReviewSpec{ResourceAttributes: &attrs}
	var ok bool
	if spec.User, spec.Groups, ok = subjectUser(subject); !ok {
		return false, fmt.Errorf("framework: %s: access review: unknown subject kind %q", c.Name, subject.Kind)
	}
	sar, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx,
		&authorizationv1.SubjectAccessReview{Spec: spec}, metav1.CreateOptions{})
	if err != nil {
		return false, fmt.Errorf("framework: %s: access review: %w", c.Name, err)
	}
	return sar.Status.Allowed, nil
}

// grantName derives a stable object name from what is granted.
func grantName(namespace string, subject rbacv1.Subject, rules []rbacv1.PolicyRule) (string, error) {
	data, err := json.Marshal(struct {
		Namespace string
		Subject   rbacv1.Subject
		Rules     []rbacv1.PolicyRule
	}{namespace, subject, rules})
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(data)
	return grantPrefix + hex.EncodeToString(sum[:8]), nil
}

// Access describes how to reach a spoke, for a ClusterProfile's
// status.accessProviders.
type Access struct {
	// ProviderName is the access provider's name, which consumers match
	// against their provider configuration.
	ProviderName string
	// Server is the spoke API server's https URL.
	Server string
	// CAData is the PEM CA that verifies Server.
	CAData []byte
	// ExecConfig, when set, is raw JSON put in the cluster extension named
	// ExecExtensionName.
	ExecConfig []byte
	// Extensions are put in the cluster after it.
	Extensions []clientcmdv1.NamedExtension
}

// CreateClusterProfile creates the namespace if needed and a ClusterProfile
// on the hub, managed by ClusterManagerName. When access is not nil it then
// sets status.accessProviders to it through the status subresource. It
// returns the ClusterProfile as last written.
func (c *Cluster) CreateClusterProfile(ctx context.Context, namespace, name string, access *Access) (*v1alpha1.ClusterProfile, error) {
	if c.Inventory == nil {
		return nil, fmt.Errorf("framework: %s: ClusterProfiles live on the hub", c.Name)
	}
	var provider v1alpha1.AccessProvider
	if access != nil {
		provider.Name = access.ProviderName
		provider.Cluster.Server = access.Server
		provider.Cluster.CertificateAuthorityData = access.CAData
		if len(access.ExecConfig) > 0 {
			if !json.Valid(access.ExecConfig) {
				return nil, fmt.Errorf("framework: %s: clusterprofile %s/%s: ExecConfig is not valid JSON", c.Name, namespace, name)
			}
			provider.Cluster.Extensions = append(provider.Cluster.Extensions, clientcmdv1.NamedExtension{
				Name: ExecExtensionName, Extension: runtime.RawExtension{Raw: access.ExecConfig},
			})
		}
		provider.Cluster.Extensions = append(provider.Cluster.Extensions, access.Extensions...)
	}
	if err := c.EnsureNamespace(ctx, namespace); err != nil {
		return nil, err
	}
	profiles := c.Inventory.ApisV1alpha1().ClusterProfiles(namespace)
	cp, err := profiles.Create(ctx, &v1alpha1.ClusterProfile{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: namespace, Name: name,
			Labels: map[string]string{v1alpha1.LabelClusterManagerKey: ClusterManagerName},
		},
		Spec: v1alpha1.ClusterProfileSpec{
			DisplayName:    name,
			ClusterManager: v1alpha1.ClusterManager{Name: ClusterManagerName},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("framework: %s: create clusterprofile %s/%s: %w", c.Name, namespace, name, err)
	}
	if access == nil {
		return cp, nil
	}
	cp.Status.AccessProviders = []v1alpha1.AccessProvider{provider}
	cp, err = profiles.UpdateStatus(ctx, cp, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("framework: %s: set status of clusterprofile %s/%s: %w", c.Name, namespace, name, err)
	}
	return cp, nil
}

// installInventory installs the CRDs in dir, waits until they are
// established and ClusterProfiles can be listed, and sets c.Inventory.
func (c *Cluster) installInventory(ctx context.Context, dir string) error {
	crds, err := readCRDs(dir)
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(crds, func(crd *apiextensionsv1.CustomResourceDefinition) bool {
		return crd.Spec.Group == v1alpha1.GroupVersion.Group && crd.Spec.Names.Plural == "clusterprofiles"
	}) {
		return fmt.Errorf("framework: no ClusterProfile CRD in %s", dir)
	}
	ext, err := apiextensions.NewForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("framework: apiextensions client: %w", err)
	}
	for _, crd := range crds {
		if _, err := ext.ApiextensionsV1().CustomResourceDefinitions().Create(ctx, crd, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("framework: %s: install CRD %s: %w", c.Name, crd.Name, err)
		}
	}
	if c.Inventory, err = inventory.NewForConfig(c.Config); err != nil {
		return fmt.Errorf("framework: inventory client: %w", err)
	}
	last := "nothing yet"
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		for _, crd := range crds {
			got, err := ext.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, crd.Name, metav1.GetOptions{})
			if err != nil {
				last = err.Error()
				return false, nil //nolint:nilerr // keep polling
			}
			if !established(got) {
				var conds []string
				for _, cond := range got.Status.Conditions {
					conds = append(conds, fmt.Sprintf("%s=%s (%s)", cond.Type, cond.Status, cond.Message))
				}
				last = fmt.Sprintf("CRD %s is not established: %s", crd.Name, strings.Join(conds, ", "))
				return false, nil
			}
		}
		// A dry-run create proves the resource is served and warms up its
		// validation (the first create of a ClusterProfile compiles its CEL
		// rules, which takes seconds on a small machine).
		_, err := c.Inventory.ApisV1alpha1().ClusterProfiles(corev1.NamespaceDefault).Create(ctx,
			&v1alpha1.ClusterProfile{
				ObjectMeta: metav1.ObjectMeta{Name: grantPrefix + "probe"},
				Spec:       v1alpha1.ClusterProfileSpec{ClusterManager: v1alpha1.ClusterManager{Name: ClusterManagerName}},
			},
			metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil {
			last = "dry-run create of a ClusterProfile: " + err.Error()
		}
		return err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("framework: %s: wait for the ClusterProfile CRD to be served (last seen: %s): %w", c.Name, last, err)
	}
	return nil
}

func established(crd *apiextensionsv1.CustomResourceDefinition) bool {
	for _, cond := range crd.Status.Conditions {
		if cond.Type == apiextensionsv1.Established {
			return cond.Status == apiextensionsv1.ConditionTrue
		}
	}
	return false
}

// readCRDs decodes every CustomResourceDefinition in the .yaml, .yml and
// .json files of dir.
func readCRDs(dir string) ([]*apiextensionsv1.CustomResourceDefinition, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("framework: read CRDs: %w", err)
	}
	var crds []*apiextensionsv1.CustomResourceDefinition
	for _, e := range entries {
		switch filepath.Ext(e.Name()) {
		case ".yaml", ".yml", ".json":
		default:
			continue
		}
		path := filepath.Join(dir, e.Name())
		f, err := os.Open(path)
		if err != nil {
			return nil, fmt.Errorf("framework: read CRDs: %w", err)
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(f, 4096)
		for {
			crd := &apiextensionsv1.CustomResourceDefinition{}
			err := dec.Decode(crd)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				_ = f.Close()
				return nil, fmt.Errorf("framework: decode %s: %w", path, err)
			}
			if crd.Kind == "CustomResourceDefinition" {
				crds = append(crds, crd)
			}
		}
		_ = f.Close()
	}
	return crds, nil
}
