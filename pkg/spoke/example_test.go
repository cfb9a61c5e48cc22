package spoke_test

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/spoke"
)

func ExampleAllowedSubjects() {
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{
		Namespace: "apps",
		Name:      "deployer",
		Annotations: map[string]string{
			spoke.AllowedSubjectsAnnotation: " system:serviceaccount:argocd:argocd-application-controller, ,alice ",
		},
	}}
	for _, s := range spoke.AllowedSubjects(sa) {
		fmt.Println(s)
	}
	// Output:
	// system:serviceaccount:argocd:argocd-application-controller
	// alice
}
